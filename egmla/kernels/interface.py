"""What both decode backends (`fused_torch`, compiled on the CPU, and `triton_decode`) take: the step's inputs and
the layer's weights and settings, as named tuples, so that the two backends and their callers agree by name."""

from typing import NamedTuple

import torch


class KVDecodeInputs(NamedTuple):
    """One decode step with the gate on the per-head keys and values (what changes from step to step)."""

    query: torch.Tensor  # [B, H, S, dn+dr], the rope part rotated
    latent: torch.Tensor  # [B, T, r]
    rope_key: torch.Tensor  # [B, T, Hr*dr], rotated ([B, T, 0] in "exact" rope mode)
    gate_rows: torch.Tensor | None  # [U, de] gate-table rows (None: gate off)
    gate_index: torch.Tensor | None  # [B, T] the row of every position; None: one row per position, in order
    key_cos: torch.Tensor | None  # [B, T, dr] "exact" rope: the rebuilt keys' rope dims turn with their positions
    key_sin: torch.Tensor | None  # [B, T, dr] (None, None: decoupled rope, the rotated rope key is `rope_key`)
    mask: torch.Tensor  # [B, S, T] bool, True = attend
    key_scale: torch.Tensor | None = None  # [B, H, T] float32: qk_norm, each key's norm scale for each query head


class KVDecodeWeights(NamedTuple):
    """What the layer contributes: its weights and settings."""

    # Per key head, each serving H / Hkv query heads (`num_key_value_heads`):
    kv_weight: torch.Tensor  # W^{UKV} [Hkv, dk+dv, r], dk = dn (decoupled rope) or dn+dr ("exact")
    gate_weight: torch.Tensor | None  # W^{UE} [Hkv, dk+dv, de]
    norm_weight: torch.Tensor | None  # gate norm [dk+dv]
    norm_eps: float
    scaling: float
    nope_dim: int
    rope_key_heads: int
    # No gate on the values (RoPE-exact keys, the gate off or on the latent): only the keys are rebuilt, the weights
    # sum the cached latents, and W^{UV} (the last dv rows of kv_weight) is applied once after.
    absorb_values: bool = False


class LatentDecodeInputs(NamedTuple):
    """One step of the absorbed MQA over [latent ; rope key] (gate off, or on the latent)."""

    query_latent: torch.Tensor  # [B, H, S, r], W^{UK} folded in
    query_rope: torch.Tensor  # [B, H, S, Hr*dr], each head's rotated rope query in its rope key's slot, zeros elsewhere
    latent: torch.Tensor  # [B, T, r]
    rope_key: torch.Tensor  # [B, T, Hr*dr]
    mask: torch.Tensor  # [B, S, T] bool
    key_scale: torch.Tensor | None = None  # [B, H, T] float32: qk_norm, each key's norm scale for each query head


# Dims that change from step to step (batch, new tokens, context, distinct tokens), by field; weights and head dims
# stay static, so each layer shape compiles once and a growing context does not recompile.
DYNAMIC_DIMS = {
    KVDecodeInputs: {
        "query": (0, 2),
        "latent": (0, 1),
        "rope_key": (0, 1),
        "gate_rows": (0,),
        "gate_index": (0, 1),
        "key_cos": (0, 1),
        "key_sin": (0, 1),
        "mask": (0, 1, 2),
        "key_scale": (0, 2),
    },
    LatentDecodeInputs: {
        "query_latent": (0, 2),
        "query_rope": (0, 2),
        "latent": (0, 1),
        "rope_key": (0, 1),
        "mask": (0, 1, 2),
        "key_scale": (0, 2),
    },
}
