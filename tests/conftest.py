"""Test-session settings; what the tests share is in tests/utils.py."""

import os

# Triton kernels run in Triton's CPU interpreter here; it must be chosen before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import egmla  # noqa: E402, F401  (registers the Auto classes and the egmla_fused attention implementations)

torch.set_num_threads(1)  # tiny models on a shared 2-core machine: threads only add noise

# Property-based tests (tests/test_properties.py): a bounded run by default, a long one by name
# (`--hypothesis-profile=long`). Fixed seeds for the default run, so that CI sees the same examples every time.
settings.register_profile(
    "default", max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("long", max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("default")
