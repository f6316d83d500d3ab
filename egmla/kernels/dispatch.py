"""Which backend runs a decode step of an `egmla_fused*` attention implementation, and the step itself.

The model (`modeling_egmla`, also Hub remote code) calls the registered attention function with an
`EGMLALatentDecode` (its decode contract, `LATENT_DECODE_VERSION`) while decoding; prefill and training run SDPA over
the expanded heads. The implementation's name chooses the backend:

- `egmla_fused`: Triton on CUDA tensors when Triton is installed, `torch.compile` of `fused_torch` on the CPU,
  otherwise the model's reference path (with one log line saying why); `EGMLA_KERNEL=reference|triton|compiled`,
  read once at import, overrides the choice;
- `egmla_fused_triton`, `egmla_fused_compiled`: that backend, or a clear error where it cannot run.

When compiling fails under `egmla_fused`'s automatic choice, or a Triton step would need autograd, the step goes
back to the reference path (and says so once); a compiled backend asked for by name raises the compile error.
"""

import importlib.util
import logging
import os

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import fused_torch
from .interface import DYNAMIC_DIMS, KVDecodeInputs, KVDecodeWeights, LatentDecodeInputs

logger = logging.getLogger(__name__)

BACKENDS = ("reference", "triton", "compiled")
IMPLEMENTATIONS = {"egmla_fused": "auto", "egmla_fused_triton": "triton", "egmla_fused_compiled": "compiled"}
SUPPORTED_DECODE_VERSIONS = (4, 5)  # of the model's EGMLALatentDecode (4: one key head per query head)
KERNEL_OVERRIDE = os.environ.get("EGMLA_KERNEL")  # read once: a process-wide choice, not a per-call switch
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_logged: set[str] = set()
_compiled: dict[str, object] = {}
_compile_failed: list[str] = []


def log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def check_backend(backend: str, device: torch.device, asked_by: str) -> str:
    """`backend` if it can run on `device`, else a ValueError naming what is missing."""
    if backend not in BACKENDS:
        raise ValueError(f"{asked_by} must be one of {BACKENDS}, got {backend!r}.")
    if backend == "triton" and not triton_available():
        raise ValueError(f"{asked_by}=triton, but Triton is not installed (pip install triton).")
    if backend == "triton" and device.type != "cuda" and not TRITON_INTERPRETED:
        raise ValueError(f"{asked_by}=triton on {device.type} tensors needs TRITON_INTERPRET=1.")
    return backend


def choose_backend(requested: str, device: torch.device) -> str:
    """The backend of an implementation ("auto", "triton" or "compiled") for tensors on `device`."""
    if requested != "auto":
        return check_backend(requested, device, "attn_implementation")
    if KERNEL_OVERRIDE:
        return check_backend(KERNEL_OVERRIDE, device, "EGMLA_KERNEL")
    if device.type == "cuda":
        if triton_available():
            return "triton"
        log_once("egmla_fused: Triton is not installed, so decoding uses the reference path (pip install triton).")
        return "reference"
    if device.type == "cpu":
        return "compiled"
    log_once(f"egmla_fused: no fused kernel for {device.type} tensors, so decoding uses the reference path.")
    return "reference"


def compiled(name: str):
    """torch.compile of a `fused_torch` function, built once; the step-dependent dims of its inputs (the first
    argument, a named tuple) are marked dynamic by field name."""
    if name not in _compiled:
        function = torch.compile(getattr(fused_torch, name), dynamic=False)

        def call(inputs, *rest):
            for field, dims in DYNAMIC_DIMS[type(inputs)].items():
                tensor = getattr(inputs, field)
                for dim in dims if tensor is not None else ():
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
            return function(inputs, *rest)

        _compiled[name] = call
    return _compiled[name]


def kernel(backend: str, name: str):
    """The `decode_kv` / `decode_latent` of a backend."""
    if backend == "triton":
        from . import triton_decode

        return getattr(triton_decode, name)
    return compiled(name)


def bool_mask(attention_mask: torch.Tensor | None, batch_size: int, query_length: int, key_length: int, device):
    """A transformers mask (None: causal; bool [B, 1, S, T]; additive float) as bool [B, S, T], True = attend."""
    if attention_mask is None:
        causal = torch.ones(query_length, key_length, dtype=torch.bool, device=device).tril(key_length - query_length)
        return causal.expand(batch_size, query_length, key_length)
    if attention_mask.dtype != torch.bool:
        attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    return attention_mask[:, 0, -query_length:, -key_length:].expand(batch_size, query_length, key_length)


def rope_query_slots(module: torch.nn.Module, q_rope: torch.Tensor) -> torch.Tensor:
    """q_rope [B, H, S, dr] -> [B, H, S, Hr*dr]: each head's rope query in its rope key's slot of the cache row."""
    batch_size, heads, query_length, _ = q_rope.shape
    rope_key_heads, group = module.rope_key_heads, heads // module.rope_key_heads
    slots = q_rope.new_zeros(batch_size, rope_key_heads, group, query_length, rope_key_heads, module.qk_rope_head_dim)
    for g in range(rope_key_heads):
        slots[:, g, :, :, g] = q_rope.view(batch_size, rope_key_heads, group, query_length, -1)[:, g]
    return slots.view(batch_size, heads, query_length, -1)


def kv_step(module: torch.nn.Module, call, mask: torch.Tensor, backend: str) -> torch.Tensor:
    """A step that rebuilds every cached key and value (gate on K/V, or "exact" rope): [B, S, H, dv]."""
    latent = call.latent[:, 0]
    gate_weight = call.gate_weight  # [Hkv, dk+dv, de], None unless the gate is on K/V
    norm = module.gate_norm if module.gate_position == "kv" else None  # a gated latent was normed before caching
    key_cos, key_sin = (call.key_rotary[0][:, 0], call.key_rotary[1][:, 0]) if call.key_rotary else (None, None)
    inputs = KVDecodeInputs(
        query=torch.cat([call.q_nope, call.q_rope], dim=-1),
        latent=latent,
        rope_key=call.rope_key[:, 0],
        gate_rows=call.gate_rows.rows if gate_weight is not None else None,
        gate_index=call.gate_rows.index if gate_weight is not None else None,
        key_cos=key_cos,
        key_sin=key_sin,
        mask=mask,
    )
    weights = KVDecodeWeights(
        kv_weight=call.kv_weight,
        gate_weight=gate_weight,
        norm_weight=norm.weight if norm is not None else None,
        norm_eps=norm.variance_epsilon if norm is not None else 0.0,
        scaling=module.scaling,
        nope_dim=module.qk_nope_head_dim,
        rope_key_heads=module.rope_key_heads,
        absorb_values=gate_weight is None,  # no gate on the values: exact rope, the gate off or on the latent
    )
    return kernel(backend, "decode_kv")(inputs, weights)


def run_step(module: torch.nn.Module, call, mask: torch.Tensor, backend: str) -> torch.Tensor:
    """One decode step of an `EGMLAAttention` through `backend`: [B, S, H, dv]."""
    if not module.absorbs:
        return kv_step(module, call, mask, backend)
    # Gate off or on the latent, decoupled rope: the absorbed MQA; fold W^{UK} into the query.
    latent, rope_key = call.latent[:, 0], call.rope_key[:, 0]
    groups = module.num_key_value_groups  # per query head (a view where each has its own)
    weight = call.kv_weight.repeat_interleave(groups, dim=0) if groups > 1 else call.kv_weight
    w_uk, w_uv = weight.split([module.qk_nope_head_dim, module.v_head_dim], dim=1)
    query_latent = torch.einsum("bhsd,hdr->bhsr", call.q_nope, w_uk)
    inputs = LatentDecodeInputs(query_latent, rope_query_slots(module, call.q_rope), latent, rope_key, mask)
    out_latent = kernel(backend, "decode_latent")(inputs, module.scaling)  # [B, H, S, r]
    return torch.einsum("bhsr,hvr->bshv", out_latent, w_uv)


def fused_decode(
    module: torch.nn.Module, call, attention_mask: torch.Tensor | None, backend: str, by_name: bool = True
) -> torch.Tensor | None:
    """The step's output [B, S, H, dv], or None to leave it to the model's reference path. `by_name`: the backend
    was asked for (an implementation's name or EGMLA_KERNEL), so its failure is an error, not a fallback."""
    if call.version not in SUPPORTED_DECODE_VERSIONS:
        log_once(
            f"egmla_fused: the model's decode contract is version {call.version}, these kernels know "
            f"{SUPPORTED_DECODE_VERSIONS}, so decoding uses the reference path (update egmla or the model's code)."
        )
        return None
    if backend == "reference" or (backend == "compiled" and _compile_failed and not by_name):
        return None
    if backend == "triton" and torch.is_grad_enabled() and (call.q_nope.requires_grad or call.latent.requires_grad):
        log_once(
            "egmla_fused: the Triton kernels have no backward, so a decode step under autograd uses the reference."
        )
        return None
    batch_size, _, query_length, _ = call.q_nope.shape
    mask = bool_mask(attention_mask, batch_size, query_length, call.latent.shape[2], call.latent.device)
    try:
        return run_step(module, call, mask, backend)
    except Exception as error:  # noqa: BLE001 - any compiler failure falls back to the reference
        if backend != "compiled":
            raise
        if by_name:
            raise RuntimeError(f"egmla_fused_compiled: torch.compile of the decode step failed: {error!r}") from error
        _compile_failed.append(repr(error))
        log_once(f"egmla_fused: torch.compile failed ({error!r:.200}), so decoding uses the reference path.")
        return None


def attention_function(requested: str):
    """The attention function registered for one implementation ("auto", "triton" or "compiled")."""

    def egmla_fused_attention(module, query, key, value, attention_mask, latent_decode=None, **kwargs):
        """Prefill and training: SDPA over the expanded heads. Decoding: the fused kernels over the latent cache."""
        if latent_decode is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        backend = choose_backend(requested, latent_decode.latent.device)
        by_name = requested != "auto" or bool(KERNEL_OVERRIDE)
        return fused_decode(module, latent_decode, attention_mask, backend, by_name), None

    return egmla_fused_attention
