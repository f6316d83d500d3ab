"""Fused decode attention over the latent cache: `attn_implementation="egmla_fused"` (the backend chosen per
device), `"egmla_fused_triton"` and `"egmla_fused_compiled"` (`dispatch` says how). Importing this module registers
them with transformers' `AttentionInterface` and `AttentionMaskInterface` (SDPA's masks); it also re-exports."""

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .dispatch import BACKENDS, IMPLEMENTATIONS, attention_function, bool_mask, choose_backend, fused_decode
from .interface import KVDecodeInputs, KVDecodeWeights, LatentDecodeInputs

ATTENTION_NAME = "egmla_fused"


def register() -> None:
    """Makes the `egmla_fused*` attention implementations available (done when this module is imported)."""
    for name, requested in IMPLEMENTATIONS.items():
        AttentionInterface.register(name, attention_function(requested))
        AttentionMaskInterface.register(name, sdpa_mask)


register()


__all__ = [
    "ATTENTION_NAME",
    "BACKENDS",
    "IMPLEMENTATIONS",
    "KVDecodeInputs",
    "KVDecodeWeights",
    "LatentDecodeInputs",
    "bool_mask",
    "choose_backend",
    "fused_decode",
    "register",
]
