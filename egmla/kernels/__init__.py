"""Fused decode attention over the latent cache: `attn_implementation="egmla_fused"`.

Registered with transformers' `AttentionInterface` (prefill and training run SDPA over the expanded heads) and
`AttentionMaskInterface` (SDPA's masks), plus an `egmla_decode` entry point that `EGMLAAttention` calls while
decoding. The backend is chosen per call:

- `EGMLA_KERNEL=reference|triton|compiled` in the environment, if set;
- otherwise Triton on CUDA tensors when Triton is installed, `torch.compile` of `fused_torch` on the CPU;
- otherwise (or when the chosen backend cannot run) the reference path of the model, with one log line saying why.
"""

import importlib.util
import logging
import os

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..modeling_egmla import causal_mask, linear_weight
from . import fused_torch

logger = logging.getLogger(__name__)

ATTENTION_NAME = "egmla_fused"
BACKENDS = ("reference", "triton", "compiled")
_logged: set[str] = set()
_compiled: dict[str, object] = {}
_compile_failed: list[str] = []


def log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose_backend(device: torch.device) -> str:
    """The backend for tensors on `device` (see the module docstring)."""
    requested = os.environ.get("EGMLA_KERNEL")
    if requested:
        if requested not in BACKENDS:
            raise ValueError(f"EGMLA_KERNEL must be one of {BACKENDS}, got {requested!r}.")
        if requested == "triton" and not triton_available():
            raise ValueError("EGMLA_KERNEL=triton, but Triton is not installed (pip install triton).")
        if requested == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"EGMLA_KERNEL=triton on {device.type} tensors needs TRITON_INTERPRET=1.")
        return requested
    if device.type == "cuda":
        if triton_available():
            return "triton"
        log_once("egmla_fused: Triton is not installed, so decoding uses the reference path (pip install triton).")
        return "reference"
    if device.type == "cpu":
        return "compiled"
    log_once(f"egmla_fused: no fused kernel for {device.type} tensors, so decoding uses the reference path.")
    return "reference"


def implementation(backend: str):
    """The module holding `decode_kv` / `decode_latent` for a backend."""
    if backend == "triton":
        from . import triton_decode

        return triton_decode
    return fused_torch


# Dims that change from step to step (batch, new tokens, context); weights and head dims stay static, so each
# layer shape compiles once and a growing context does not recompile.
DYNAMIC_DIMS = {
    "decode_kv": {0: (0, 2), 1: (0, 1), 2: (0, 1), 3: (0,), 4: (0, 1), 9: (0, 1, 2)},
    "decode_latent": {0: (0, 2), 1: (0, 2), 2: (0, 1), 3: (0, 1), 4: (0, 1, 2)},
}


def compiled(name: str):
    """torch.compile of a `fused_torch` function, built once; the step-dependent dims are marked dynamic."""
    if name not in _compiled:
        function = torch.compile(getattr(fused_torch, name), dynamic=False)

        def call(*arguments):
            for index, dims in DYNAMIC_DIMS[name].items():
                if arguments[index] is not None:
                    for dim in dims:
                        torch._dynamo.maybe_mark_dynamic(arguments[index], dim)
            return function(*arguments)

        _compiled[name] = call
    return _compiled[name]


def bool_mask(attention_mask: torch.Tensor | None, batch_size: int, query_length: int, key_length: int, device):
    """A transformers mask (None: causal; bool [B, 1, S, T]; additive float) as bool [B, S, T], True = attend."""
    if attention_mask is None:
        return causal_mask(query_length, key_length, device).expand(batch_size, query_length, key_length)
    if attention_mask.dtype != torch.bool:
        attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    return attention_mask[:, 0, -query_length:, -key_length:].expand(batch_size, query_length, key_length)


# Above this share of distinct tokens in the context, gathering the gate per position costs more than it saves.
DISTINCT_TOKEN_SHARE = 0.75


def distinct_gate_rows(
    gate_embedding: torch.Tensor, token_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gate-table rows of the context's distinct tokens [U, de] and the row of every position [B, T].

    Real text repeats its tokens (2048 TinyStories tokens hold ~500 distinct ones), so the gate product, most of
    the arithmetic of a decode step, is computed once per distinct token. Without ids, or with few repeats, the
    rows are returned one per position [B*T, de] with no index.
    """
    batch_size, key_length, width = gate_embedding.shape
    rows = gate_embedding.reshape(batch_size * key_length, width)
    if token_ids is None or token_ids.shape != (batch_size, key_length):
        return rows, None
    distinct, index = torch.unique(token_ids, return_inverse=True)
    if distinct.numel() > DISTINCT_TOKEN_SHARE * token_ids.numel():
        return rows, None
    positions = torch.arange(rows.shape[0], device=rows.device)
    # Every position of a token holds the same row; the scatter keeps one of them.
    some_position = positions.new_empty(distinct.shape).scatter_(0, index.flatten(), positions)
    return rows[some_position], index


def fused_decode(
    module: torch.nn.Module,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    rope_key: torch.Tensor,
    gate_embedding: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    token_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One decode step of an `EGMLAAttention` over its cache: [B, S, H, dv], or None for the reference path.

    q_nope [B, H, S, dn], q_rope [B, H, S, dr] (rotated), latent [B, 1, T, r], rope_key [B, 1, T, Hr*dr];
    for gate_position="kv", gate_embedding [B, T, de] holds the gate-table rows of the context's token_ids [B, T].
    """
    backend = choose_backend(latent.device)
    if backend == "reference" or (backend == "compiled" and _compile_failed):
        return None
    if backend == "triton" and torch.is_grad_enabled() and (q_nope.requires_grad or latent.requires_grad):
        log_once(
            "egmla_fused: the Triton kernels have no backward, so a decode step under autograd uses the reference."
        )
        return None
    batch_size, heads, query_length, _ = q_nope.shape
    key_length = latent.shape[2]
    mask = bool_mask(attention_mask, batch_size, query_length, key_length, latent.device)
    latent, rope_key = latent[:, 0], rope_key[:, 0]
    weight = module.kv_b_weight(like=latent)  # [H, dn+dv, r]
    gate_rows, gate_index = None, None
    if backend == "compiled" and module.gate_position == "kv" and module.gate_embedding_proj is not None:
        gate_rows, gate_index = distinct_gate_rows(gate_embedding, token_ids)
    try:
        if module.gate_position == "kv":
            gate = module.gate_embedding_proj
            gate_weight = None
            if gate is not None:
                gate_weight = linear_weight(gate, gate.in_features, latent).view(heads, weight.shape[1], -1)
            query = torch.cat([q_nope, q_rope], dim=-1)
            norm = module.gate_norm
            weights = (weight, gate_weight, norm.weight if norm is not None else None)
            weights += (norm.variance_epsilon if norm is not None else 0.0,)
            settings = (mask, module.scaling, module.qk_nope_head_dim, module.rope_key_heads)
            if backend == "triton":
                function, arguments = implementation(backend).decode_kv, (query, latent, rope_key, gate_embedding)
            else:
                function, arguments = compiled("decode_kv"), (query, latent, rope_key, gate_rows, gate_index)
            arguments = arguments + weights + settings
            return function(*arguments)
        # gate_position="latent": the cached latent is already gated; fold W^{UK} into the query.
        w_uk, w_uv = weight.split([module.qk_nope_head_dim, module.v_head_dim], dim=1)
        query_latent = torch.einsum("bhsd,hdr->bhsr", q_nope, w_uk)
        group = heads // module.rope_key_heads
        # Each head's rope query in its rope key's slot of the [B, T, Hr*dr] cache row, zeros elsewhere.
        slots = torch.zeros(
            batch_size, module.rope_key_heads, group, query_length, module.rope_key_heads, module.qk_rope_head_dim,
            device=q_rope.device, dtype=q_rope.dtype,
        )  # fmt: skip
        for g in range(module.rope_key_heads):
            slots[:, g, :, :, g] = q_rope.view(batch_size, module.rope_key_heads, group, query_length, -1)[:, g]
        query_rope = slots.view(batch_size, heads, query_length, -1)
        function = compiled("decode_latent") if backend == "compiled" else implementation(backend).decode_latent
        out_latent = function(query_latent, query_rope, latent, rope_key, mask, module.scaling)  # [B, H, S, r]
        return torch.einsum("bhsr,hvr->bshv", out_latent, w_uv)
    except Exception as error:  # noqa: BLE001 - any compiler failure falls back to the reference
        if backend != "compiled":
            raise
        _compile_failed.append(repr(error))
        log_once(f"egmla_fused: torch.compile failed ({error!r:.200}), so decoding uses the reference path.")
        return None


def egmla_fused_attention(module, query, key, value, attention_mask, **kwargs):
    """Prefill and training: SDPA over the expanded heads (the decode steps go through `egmla_decode`)."""
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


fused_decode.takes_token_ids = True
egmla_fused_attention.egmla_decode = fused_decode


def register() -> None:
    """Makes `attn_implementation="egmla_fused"` available (done by `import egmla`)."""
    AttentionInterface.register(ATTENTION_NAME, egmla_fused_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


__all__ = ["ATTENTION_NAME", "BACKENDS", "choose_backend", "fused_decode", "register"]
