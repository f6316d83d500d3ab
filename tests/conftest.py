"""Test-session settings; what the tests share is in tests/utils.py."""

import os

# Triton kernels run in Triton's CPU interpreter here; it must be chosen before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import egmla  # noqa: E402, F401  (registers the Auto classes and the egmla_fused attention implementations)

torch.set_num_threads(1)  # tiny models on a shared 2-core machine: threads only add noise
