"""The mixed-precision policy: where forward passes (fitting, recovery, scoring) run under bfloat16 autocast, with the
weights and the optimizer in float32."""

import torch

MIXED_PRECISIONS = ("no", "bf16", "auto")

# Below this width autocast's casts cost more than bf16 saves, on a CPU with AVX512-BF16 (docs/results.md#behind-the-defaults).
BF16_MIN_HIDDEN_SIZE = 512


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 natively (elsewhere bf16 autocast emulates it, slower than fp32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private, hence looked up with care
        return any(getattr(torch.cpu, name, lambda: False)() for name in checks)
    return False


def uses_bf16(mixed_precision: str, device: torch.device, hidden_size: int) -> bool:
    """Whether forward passes run under bf16 autocast: asked for, or "auto" on a device that computes bf16 natively
    for a model wide enough to gain from it."""
    if mixed_precision != "auto":
        return mixed_precision == "bf16"
    return hidden_size >= BF16_MIN_HIDDEN_SIZE and native_bf16(device)


def bf16_autocast(device: torch.device, enabled: bool) -> torch.autocast:
    """bfloat16 autocast on `device` where `enabled`, else a disabled one (a fitting's or a scoring's passes)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def fitting_autocast(mixed_precision: str, device: torch.device, hidden_size: int) -> torch.autocast:
    """The autocast a fitting's forward passes run under: bfloat16 where `uses_bf16` says so, else disabled."""
    return bf16_autocast(device, uses_bf16(mixed_precision, device, hidden_size))
