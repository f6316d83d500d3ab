"""Which backend runs a decode step of an `egmla_fused*` attention implementation, and the step itself.

The model (`modeling_egmla`, also Hub remote code) calls the registered attention function with `step=`, an
`EGMLAStep` (its decode contract, `LATENT_DECODE_VERSION`), while decoding; prefill and training run SDPA over the
expanded heads. Everything here reads the step (its layout and weights), never the layer. The implementation's name
chooses the backend:

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
SUPPORTED_DECODE_VERSIONS = (7,)  # of the model's EGMLAStep (7: it carries the key-norm scales)
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

        def run(inputs, *rest):
            for field, dims in DYNAMIC_DIMS[type(inputs)].items():
                tensor = getattr(inputs, field)
                for dim in dims if tensor is not None else ():
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
            return function(inputs, *rest)

        _compiled[name] = run
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


def rope_query_slots(layout, q_rope: torch.Tensor) -> torch.Tensor:
    """q_rope [B, H, S, dr] -> [B, H, S, Hr*dr]: each head's rope query in its rope key's slot of the cache row."""
    batch_size, heads, query_length, _ = q_rope.shape
    rope_key_heads, group = layout.rope_key_heads, heads // layout.rope_key_heads
    slots = q_rope.new_zeros(batch_size, rope_key_heads, group, query_length, rope_key_heads, layout.qk_rope_head_dim)
    for g in range(rope_key_heads):
        slots[:, g, :, :, g] = q_rope.view(batch_size, rope_key_heads, group, query_length, -1)[:, g]
    return slots.view(batch_size, heads, query_length, -1)


def per_head_key_scale(step) -> torch.Tensor | None:
    """qk_norm: the cached key-norm scales [B, 1, T, Hn] as each query head reads them, [B, H, T] float32."""
    if step.key_scale is None:
        return None
    heads = step.q_nope.shape[1]
    return step.key_scale[:, 0].transpose(1, 2).float().repeat_interleave(heads // step.key_scale.shape[-1], dim=1)


def kv_step(step, mask: torch.Tensor, backend: str) -> torch.Tensor:
    """A step that rebuilds every cached key and value (gate on K/V, or "exact" rope): [B, S, H, dv]."""
    layout, gate_weight = step.layout, step.gate_weight  # [Hkv, dk+dv, de], None unless the gate is on K/V
    key_cos, key_sin = (step.key_rotary[0][:, 0], step.key_rotary[1][:, 0]) if step.key_rotary else (None, None)
    inputs = KVDecodeInputs(
        query=torch.cat([step.q_nope, step.q_rope], dim=-1),
        latent=step.latent[:, 0],
        rope_key=step.rope_key[:, 0],
        gate_rows=step.gate_rows.rows if gate_weight is not None else None,
        gate_index=step.gate_rows.index if gate_weight is not None else None,
        key_cos=key_cos,
        key_sin=key_sin,
        mask=mask,
        key_scale=per_head_key_scale(step),
    )
    weights = KVDecodeWeights(
        kv_weight=step.kv_weight,
        gate_weight=gate_weight,
        norm_weight=step.norm_weight,  # None with the gate on the latent: it was normed before caching
        norm_eps=layout.norm_eps if step.norm_weight is not None else 0.0,
        scaling=layout.scaling,
        nope_dim=layout.qk_nope_head_dim,
        rope_key_heads=layout.rope_key_heads,
        absorb_values=gate_weight is None,  # no gate on the values: exact rope, the gate off or on the latent
    )
    return kernel(backend, "decode_kv")(inputs, weights)


def run_step(step, mask: torch.Tensor, backend: str) -> torch.Tensor:
    """One decode step through `backend`: [B, S, H, dv]."""
    if not step.layout.absorbs:
        return kv_step(step, mask, backend)
    # Gate off or on the latent, decoupled rope: the absorbed MQA, W^{UK} folded into the query.
    inputs = LatentDecodeInputs(
        query_latent=torch.einsum("bhsd,hdr->bhsr", step.q_nope, step.uk_weight),
        query_rope=rope_query_slots(step.layout, step.q_rope),
        latent=step.latent[:, 0],
        rope_key=step.rope_key[:, 0],
        mask=mask,
        key_scale=per_head_key_scale(step),
    )
    out_latent = kernel(backend, "decode_latent")(inputs, step.layout.scaling)  # [B, H, S, r]
    return torch.einsum("bhsr,hrv->bshv", out_latent, step.uv_weight)


def fused_decode(step, attention_mask: torch.Tensor | None, backend: str, by_name: bool = True) -> torch.Tensor | None:
    """The step's output [B, S, H, dv], or None to leave it to the model's reference path. `by_name`: the backend
    was asked for (an implementation's name or EGMLA_KERNEL), so its failure is an error, not a fallback."""
    if step.version not in SUPPORTED_DECODE_VERSIONS:
        log_once(
            f"egmla_fused: the model's decode contract is version {step.version}, these kernels know "
            f"{SUPPORTED_DECODE_VERSIONS}, so decoding uses the reference path (update egmla or the model's code)."
        )
        return None
    if backend == "reference" or (backend == "compiled" and _compile_failed and not by_name):
        return None
    if step.layout.kv_norm and step.norm_weight is None:
        log_once("egmla_fused: an offload hook holds the gate norm's weight, so decoding uses the reference path.")
        return None
    if backend == "triton" and torch.is_grad_enabled() and (step.q_nope.requires_grad or step.latent.requires_grad):
        log_once(
            "egmla_fused: the Triton kernels have no backward, so a decode step under autograd uses the reference."
        )
        return None
    batch_size, _, query_length, _ = step.q_nope.shape
    mask = bool_mask(attention_mask, batch_size, query_length, step.latent.shape[2], step.latent.device)
    try:
        return run_step(step, mask, backend)
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

    def egmla_fused_attention(module, query, key, value, attention_mask, **kwargs):
        """Prefill and training: SDPA over the expanded heads. Decoding (`step=`): the fused kernels over the latent
        cache, which read the step alone."""
        step = kwargs.pop("step", None)
        if step is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        backend = choose_backend(requested, step.latent.device)
        by_name = requested != "auto" or bool(KERNEL_OVERRIDE)
        return fused_decode(step, attention_mask, backend, by_name), None

    return egmla_fused_attention
