"""EG-MLA: Embedding-Gated Multi-head Latent Attention (arXiv 2509.16686) for Hugging Face transformers.

Read top to bottom: norms, rotary embedding, MLP, the latent cache, the attention, the decoder layer, the models.
Shapes use B batch, S new tokens, T cached + new tokens, H query heads, Hr rope keys, r = kv_lora_rank,
dn/dr/dv = qk_nope/qk_rope/v head dims, de = gate_embedding_dim.

This file is also shipped as Hub remote code: it imports only torch, transformers and `configuration_egmla`.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticLayer
from transformers.generation import GenerationMixin
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_egmla import EGMLA_LAYER_TYPE, EGMLA_SLIDING_LAYER_TYPE, EGMLAConfig

logger = logging.get_logger(__name__)


class EGMLARMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMS norm's arithmetic, also applied by the decode paths with the weight their step carries."""
    input_dtype = hidden_states.dtype
    if input_dtype == weight.dtype == torch.float32:  # the same arithmetic in one fused pass
        return nn.functional.rms_norm(hidden_states, weight.shape, weight, eps)
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


class EGMLARotaryEmbedding(nn.Module):
    """Rotary cos/sin [B, S, F] over F = `rope_frequency_dim` dims (the config's `head_dim`, which the rope
    utilities read); the model then picks each rope key head's dims out of them. `rope_theta`: a default-type
    rotary of that base instead of the config's (the windowed layers', `sliding_rope_theta`)."""

    def __init__(self, config: EGMLAConfig, rope_theta: float | None = None):
        super().__init__()
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.rope_theta = rope_theta
        self.rope_type = "default" if rope_theta is not None else config.rope_parameters["rope_type"]
        if self.rope_type == "default":
            inv_freq, self.attention_scaling = self.compute_default_rope_parameters(config, rope_theta=rope_theta)
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(
        config: EGMLAConfig, rope_theta: float | None = None, **kwargs
    ) -> tuple[torch.Tensor, float]:
        base = rope_theta or config.rope_parameters["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates `x` [B, Hx, S, dr] by `cos`/`sin` [B, Hc, S, dr], head group h of x using row h // (Hx / Hc)
    (half-split layout, as Llama and DeepSeek-V3)."""
    batch_size, heads, seq_length, dim = x.shape
    x = x.view(batch_size, cos.shape[1], -1, seq_length, dim)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return ((x * cos) + (rotate_half(x) * sin)).view(batch_size, heads, seq_length, dim)


def rotary_dims(config: EGMLAConfig, layer_idx: int) -> list[list[int]] | None:
    indices = config.rope_frequency_indices
    if indices is None and config.head_dim == config.qk_rope_head_dim:
        return None
    heads = indices[layer_idx] if indices is not None else [list(range(config.qk_rope_head_dim // 2))]
    half = config.head_dim // 2
    # Half-split layout: pair j of a head sits at dims j and j + dr/2, frequency f at dims f and f + F/2.
    return [head + [index + half for index in head] for head in heads]


def attention_scaling(config: EGMLAConfig) -> float:
    """1/sqrt(qk head dim), times DeepSeek's YaRN mscale^2 when `mscale_all_dim` is set."""
    scaling = config.qk_head_dim**-0.5
    rope = config.rope_parameters
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scaling = scaling * mscale * mscale
    return scaling


class EGMLAMLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, config: EGMLAConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class EGMLAGateTable(nn.Embedding):
    """E^{(k)}: one gate-embedding row per token id. Rows start with unit variance so that the zero-initialised
    up-projection receives gradients of a normal size.

    Offloaded (RWKV-8's DeepEmbed), the table stays in CPU memory whatever device the model goes to, and a forward
    moves only the rows it is asked for (the model asks for those of the distinct tokens in flight); gradients flow
    back to the CPU rows (one process: DDP and FSDP expect every parameter on the accelerator).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, offload: bool = False, **kwargs):
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.offload = offload

    def extra_repr(self) -> str:
        return super().extra_repr() + (", offload=True" if self.offload else "")

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if not self.offload:
            return super().forward(token_ids)
        rows = nn.functional.embedding(token_ids.to(self.weight.device), self.weight)  # in CPU memory
        if token_ids.device.type == "cuda" and not (torch.is_grad_enabled() and rows.requires_grad):
            rows = rows.pin_memory()  # an asynchronous copy (autograd needs the plain one)
        return rows.to(token_ids.device, non_blocking=True)

    def _apply(self, fn, recurse: bool = True):
        if not self.offload or self.weight.is_meta:  # being built or loaded: placed afterwards
            return super()._apply(fn, recurse)
        target = fn(torch.empty(0, dtype=self.weight.dtype))
        if target.device.type == "cpu":  # a change of dtype, share_memory, to_empty: as asked
            return super()._apply(lambda tensor: cpu_memory(fn(tensor)), recurse)
        # A move to an accelerator: keep the change of dtype, stay in CPU memory.
        return super()._apply(lambda tensor: cpu_memory(tensor.to(dtype=target.dtype)), recurse)

    @torch.no_grad()
    def resized(self, num_embeddings: int) -> "EGMLAGateTable":
        """This table with `num_embeddings` rows: the kept rows copied, new rows zero (their gate is the identity)."""
        weight = self.weight
        table = EGMLAGateTable(num_embeddings, self.embedding_dim, offload=self.offload, device=weight.device,
                               dtype=weight.dtype)  # fmt: skip
        kept = min(num_embeddings, self.num_embeddings)
        table.weight.zero_()
        table.weight[:kept] = weight[:kept]
        table.weight.requires_grad_(weight.requires_grad)
        table.place_in_cpu_memory()  # offloaded: pinned CPU memory, as the old one
        return table

    def place_in_cpu_memory(self) -> None:
        """Back to CPU memory after a load that placed the table elsewhere (a `device_map`)."""
        if not self.offload:
            return
        if self.weight.is_meta:  # accelerate's CPU offload: it would copy the whole table over at every call
            raise ValueError(
                "offload_gate_tables keeps the gate tables in CPU memory itself: leave them out of accelerate's "
                "offload (give the model one device, e.g. device_map='cuda', or map `model.gate_embeddings` to "
                "the accelerator and let the option move it)."
            )
        self._apply(lambda tensor: tensor)


def cpu_memory(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in CPU memory, pinned when CUDA is present so that rows copy over asynchronously."""
    tensor = tensor.to("cpu")
    if torch.cuda.is_available() and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor


class EGMLAGateProjection(nn.Linear):
    """W^{UE}: gate embedding -> gate. It starts at zero, so a fresh gate 1 + W^{UE} e is the identity."""


class EGMLAHeadProjection(nn.Module):
    """One linear map per head, [H, out, in] (`qk_norm`: each normed query head to its `[nope ; rope]` query)."""

    def __init__(self, heads: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, out_features, in_features))

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """[B, S, H, in] -> [B, H, S, out]."""
        return torch.einsum("bshi,hoi->bhso", states, self.weight)


def key_norm_scale(keys: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / rms of each key head [B, S, Hn, d] -> [B, S, Hn], in float32: what the source's key norm multiplies it
    by, before its weight."""
    return torch.rsqrt(keys.float().pow(2).mean(-1) + eps)


# Cached positions a re-expanding decode step expands at a time: [B, 128, Hkv*(dk+dv)] stays in a CPU core's cache.
DECODE_BLOCK = 128

# Above this share of distinct tokens in the context, computing the gate per distinct token and gathering it per
# position costs more than computing it per position.
DISTINCT_TOKEN_SHARE = 0.75


class EGMLAGateRows(NamedTuple):
    """The gate-table rows one layer needs, looked up once per forward for the whole model.

    The gate 1 + W^{UE} E[x_t] depends on the token only and real text repeats its tokens (2048 TinyStories tokens
    hold ~500 distinct ones), so `rows` [U, de] are those of the distinct tokens and `index` [B, T] says which row
    each position uses; with few repeats, `rows` [B*T, de] are one per position, in order, and `index` is None.
    """

    rows: torch.Tensor
    index: torch.Tensor | None
    batch_size: int
    length: int


def gate_block(gate: torch.Tensor, gate_rows: EGMLAGateRows, start: int, end: int) -> torch.Tensor:
    """The gate [B, end - start, W] of positions start..end from its values per row `gate` [U, W]."""
    if gate_rows.index is None:
        return gate.view(gate_rows.batch_size, gate_rows.length, -1)[:, start:end]
    index = gate_rows.index[:, start:end]
    return gate.index_select(0, index.flatten()).view(*index.shape, -1)  # faster than gate[index] on a CPU


def look_up_gate_rows(tables: nn.ModuleList, token_ids: torch.Tensor) -> list[EGMLAGateRows]:
    """Per gate table, the rows of the tokens `token_ids` [B, T] (an offloaded table moves only distinct ones)."""
    if torch.compiler.is_compiling():  # the number of distinct tokens is data: one row per position keeps one graph
        return [EGMLAGateRows(table(token_ids).flatten(0, 1), None, *token_ids.shape) for table in tables]
    distinct, index = torch.unique(token_ids, return_inverse=True)
    per_position = distinct.numel() > DISTINCT_TOKEN_SHARE * token_ids.numel()
    looked_up = []
    for table in tables:
        rows = table(distinct)  # [U, de]
        if per_position:
            looked_up.append(EGMLAGateRows(rows[index].flatten(0, 1), None, *token_ids.shape))
        else:
            looked_up.append(EGMLAGateRows(rows, index, *token_ids.shape))
    return looked_up


# ----------------------------------------------------------------------------------------------------------------
# The latent cache
# ----------------------------------------------------------------------------------------------------------------


class EGMLALatentCacheLayer(DynamicLayer):
    """One layer's cache: the latent `keys` [B, 1, T, r] and the rotated rope keys `values` [B, 1, T, Hr*dr]
    (width 0 with `rope_mode="exact"`; with `qk_norm`, each key's norm scales follow them: Hr*dr + Hn wide).

    Both are kept as single-"head" 4-D tensors, as DeepSeek does, so every generic cache path (masks, offload,
    beam reorder) works unchanged. The layer that the model asks to (layer 0) also keeps, once per sequence, what
    the model needs per cached token: the token ids [B, T] (to rebuild the gate of past tokens, gate on K/V) and the
    positions [B, T] (to rotate the keys rebuilt from the latent, `rope_mode="exact"`); every batch or length
    operation keeps them aligned with the latent.
    """

    _layer_type = EGMLA_LAYER_TYPE
    PER_TOKEN = ("token_ids", "positions")
    GROWTH_CHUNK = 256  # positions the storage grows by: one copy of the cache per chunk, not per step

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.token_ids: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        # [B, 1, capacity, r + Hr*dr] behind `keys` (its first r values) and `values` (the rest): each cached row is
        # [latent ; rope key], so the absorbed decode reads both as one key (`cached_rows`)
        self.storage: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Appends the new latents [B, 1, S, r] and rope keys [B, 1, S, Hr*dr]; `keys`/`values` are views of the
        first T positions of a storage that grows GROWTH_CHUNK positions at a time, so that a decode step writes
        its own token instead of copying the whole cache (at most GROWTH_CHUNK - 1 positions stay unused)."""
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            self.storage = None  # autograd keeps the earlier views for backward: writing into them would break it
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        total = length + key_states.shape[-2]
        width = key_states.shape[-1]
        if not self.holds_views(key_states, value_states, total):
            capacity = math.ceil(total / self.GROWTH_CHUNK) * self.GROWTH_CHUNK
            storage = key_states.new_zeros(*key_states.shape[:2], capacity, width + value_states.shape[-1])
            if length:
                storage[:, :, :length, :width] = self.keys
                storage[:, :, :length, width:] = self.values
            self.storage = storage
        self.storage[:, :, length:total, :width] = key_states
        self.storage[:, :, length:total, width:] = value_states
        self.keys, self.values = self.storage[:, :, :total, :width], self.storage[:, :, :total, width:]
        return self.keys, self.values

    def holds_views(self, key_states: torch.Tensor, value_states: torch.Tensor, total: int) -> bool:
        """Whether `keys` and `values` still view the storage (a reorder, offload or move replaces them) with room
        for `total` positions of rows as wide as the new ones."""
        if self.storage is None or self.keys.numel() == 0:
            return False
        width = self.keys.shape[-1]
        return (
            self.keys.data_ptr() == self.storage.data_ptr()
            and self.values.data_ptr() == self.storage[..., width:].data_ptr()
            and width == key_states.shape[-1]
            and self.storage.shape[-1] == width + value_states.shape[-1]
            and self.storage.shape[:2] == key_states.shape[:2]
            and self.storage.dtype == key_states.dtype
            and self.storage.device == key_states.device
            and self.storage.shape[2] >= total
        )

    def cached_rows(self) -> torch.Tensor | None:
        """The cached rows [latent ; rope key] [B, 1, T, r + Hr*dr] as one view of the storage, or None where `keys`
        and `values` no longer view it (a reorder, an offload, a backward-kept update)."""
        if self.storage is None or self.keys.numel() == 0 or self.keys.data_ptr() != self.storage.data_ptr():
            return None
        return self.storage[:, :, : self.keys.shape[-2]]

    def append_per_token(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """Appends the new tokens' `name` values [B, S] and returns those of the whole context [B, T]."""
        held = getattr(self, name)
        setattr(self, name, values if held is None else torch.cat([held, values.to(held.device)], dim=-1))
        return getattr(self, name)

    def map_per_token(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in self.PER_TOKEN:
            if getattr(self, name) is not None:
                setattr(self, name, function(getattr(self, name)))

    def reset(self) -> None:
        super().reset()
        self.token_ids = self.positions = self.storage = None

    def offload(self) -> None:
        self.storage = None  # else the whole storage would stay on the accelerator
        super().offload()

    def crop(self, max_length: int) -> None:
        super().crop(max_length)
        if self.is_initialized:  # keep as many tokens as the latent holds now
            kept = self.get_seq_length()
            self.map_per_token(lambda values: values[:, :kept])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.map_per_token(lambda values: values.index_select(0, beam_idx.to(values.device)))
        self.storage = None  # `keys` and `values` are new tensors now: the next update allocates anew

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.map_per_token(lambda values: values.repeat_interleave(repeats, dim=0))
        self.storage = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.map_per_token(lambda values: values[indices, ...])
        self.storage = None


class EGMLASlidingLatentCacheLayer(EGMLALatentCacheLayer):
    """A windowed layer's cache (`sliding_window_layers`): only the last `sliding_window - 1` positions are kept,
    which is all the next token sees besides itself, as transformers' `DynamicSlidingWindowLayer` keeps keys and
    values (and, as it does, everything while `generate` records the past to roll back drafted tokens). Held in
    layer 0, the per-token values stay whole (the full layers read them). The window comes with the first update
    (DynamicCache builds this type without it)."""

    _layer_type = EGMLA_SLIDING_LAYER_TYPE
    is_sliding = True

    def __init__(self, sliding_window: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.sliding_window = sliding_window
        self.cumulative_length = 0
        self.record_past = False

    def activate_past_recording(self, **kwargs) -> None:
        self.record_past = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, sliding_window=None, **kwargs):
        """Appends the new latents and rope keys; returns the kept positions and the new ones."""
        self.sliding_window = sliding_window or self.sliding_window
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keys, values = torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)
        total = keys.shape[-2]
        start = 0 if self.record_past else max(total - self.sliding_window + 1, 0)
        self.keys, self.values = keys[:, :, start:], values[:, :, start:]
        visible = max(total - self.sliding_window + 1 - key_states.shape[-2], 0)  # what the new queries can see
        return keys[:, :, visible:], values[:, :, visible:]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The kept positions and the new ones, and the position of the first kept one (as transformers')."""
        if self.sliding_window is None:  # nothing cached yet
            return self.cumulative_length + query_length, 0
        kept = min(self.cumulative_length, self.sliding_window - 1)
        return kept + query_length, self.cumulative_length - kept

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def cached_rows(self) -> None:
        return None  # no storage: the latent and the rope keys are separate tensors

    def crop(self, max_length: int) -> None:
        """Before the window is full as a full layer's; beyond it, only while recording the past and by a number of
        tokens to remove (negative), the kept positions cut back to the window (transformers' rule)."""
        if self.sliding_window is None or self.cumulative_length < self.sliding_window:
            super().crop(max_length)
            self.cumulative_length = self.keys.shape[-2] if self.is_initialized else 0
            return
        if not self.record_past or max_length > 0:
            raise ValueError(
                f"A windowed layer's cache holding its window ({self.sliding_window}) can be cropped only by a "
                "negative number of tokens while `generate` records the past: earlier positions are gone."
            )
        removed, window = -max_length, self.sliding_window - 1
        end = self.keys.shape[-2] - removed
        self.keys, self.values = self.keys[:, :, max(end - window, 0) : end], self.values[:, :, max(end - window, 0) : end]
        self.cumulative_length -= removed
        self.map_per_token(lambda values: values[:, : self.cumulative_length])

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0


class EGMLAStaticCacheLayer(StaticLayer):
    """The preallocated twin of `EGMLALatentCacheLayer` (`cache_implementation="static"`, `torch.compile`): the
    latent [B, 1, L, r] and rope keys [B, 1, L, Hr*dr] of L = max_cache_len positions, side by side in one storage
    and written in place, and in layer 0 the token ids and positions [B, L] the mode needs; the attention mask hides
    the unwritten slots, so every step has the same shapes and a compiled decode step does not recompile."""

    _layer_type = EGMLA_LAYER_TYPE
    PER_TOKEN = ("token_ids", "positions")

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__(max_cache_len=max_cache_len, **kwargs)
        self.token_ids: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.storage: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """One storage [B, 1, L, r + Hr*dr] behind `keys` (the latent) and `values` (the rope keys), as in the
        dynamic layer, so that the absorbed decode reads each cached row once (`cached_rows`), compiled too."""
        self.device = key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        shape = (self.batch_size, self.num_heads, self.max_cache_len, self.k_head_dim + self.v_head_dim)
        self.storage = key_states.new_zeros(shape)
        self.view_storage()
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not torch.compiler.is_compiling():  # fixed addresses: a compiled step is not rebuilt per update
            for tensor in (self.storage, self.keys, self.values, self.cumulative_length):
                torch._dynamo.mark_static_address(tensor)
        self.is_initialized = True

    def view_storage(self) -> None:
        """`keys` and `values` as views of the storage: its first r values per row, and the rest."""
        self.keys, self.values = self.storage[..., : self.k_head_dim], self.storage[..., self.k_head_dim :]

    def cached_rows(self) -> torch.Tensor | None:
        """All L rows [latent ; rope key] [B, 1, L, r + Hr*dr] (the mask hides the unwritten ones); None while
        offloaded (`update` offloads an offloaded cache's layer before the attention reads it)."""
        return self.storage if self.storage is not None and self.storage.device == self.device else None

    def offload(self) -> None:
        if self.is_initialized:  # the storage moves, and the views follow it
            self.storage = self.storage.to("cpu", non_blocking=True)
            self.view_storage()

    def prefetch(self) -> None:
        if self.is_initialized and self.storage.device != self.device:
            self.storage = self.storage.to(self.device, non_blocking=True)
            self.view_storage()

    def append_per_token(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """Writes the new tokens' `name` values [B, S] into their slots; returns the whole row [B, L]."""
        held = getattr(self, name)
        if held is None:
            held = values.new_zeros(values.shape[0], self.max_cache_len)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(held)
            setattr(self, name, held)
        # Called before this step's `update` (by the model, once per forward): the slots after the cached ones.
        slots = torch.arange(values.shape[1], device=held.device) + self.cumulative_length.to(held.device)
        held.index_copy_(1, slots, values.to(held.device))
        return held

    def reset(self) -> None:
        super().reset()
        for name in self.PER_TOKEN:
            if getattr(self, name) is not None:
                getattr(self, name).zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """In place, so that the static addresses a compiled step was built on stay valid."""
        for tensor in (self.storage, self.token_ids, self.positions):
            if tensor is not None:
                tensor.copy_(tensor.index_select(0, beam_idx.to(tensor.device)))


class EGMLAStaticSlidingCacheLayer(EGMLAStaticCacheLayer):
    """A windowed layer in a static cache: every position is kept in place (the window is the mask's), so that every
    layer's shapes stay fixed for a compiled step."""

    _layer_type = EGMLA_SLIDING_LAYER_TYPE


class EGMLACache(DynamicCache):
    """A `DynamicCache` of `EGMLALatentCacheLayer`s, for passing explicitly: `model(..., cache=EGMLACache(config))`.

    `generate` builds an equivalent `DynamicCache(config=...)` by itself (the config's `layer_types` name our
    layer); `cache_nbytes` measures either.
    """

    def __init__(self, config: EGMLAConfig, offloading: bool = False):
        super().__init__(config=config, offloading=offloading)

    @property
    def token_ids(self) -> torch.Tensor | None:
        return self.layers[0].token_ids

    def nbytes(self) -> int:
        return cache_nbytes(self)


def first_latent_layer(cache: Cache, needs: str) -> "EGMLALatentCacheLayer":
    """Layer 0 of an EG-MLA cache, which keeps the per-token values; a clear error for any other cache."""
    first_layer = cache.layers[0] if len(cache.layers) else None
    if not is_latent_cache_layer(first_layer):
        raise ValueError(
            f"EG-MLA with {needs} needs a cache that keeps them per token: pass `EGMLACache(model.config)` or "
            f"`DynamicCache(config=model.config)`, not {type(cache).__name__} with {type(first_layer).__name__} "
            "layers."
        )
    return first_layer


def context_token_ids(cache: Cache | None, input_ids: torch.Tensor, config: EGMLAConfig) -> torch.Tensor:
    """The token ids whose gate the layers need: with `gate_position="kv"` and a cache, those of the whole context
    (the new ids [B, S] are appended to the cache's, kept once by layer 0); otherwise the new ones."""
    if cache is None or not config.caches_token_ids:
        return input_ids
    return first_latent_layer(cache, "gate_position='kv' (token ids)").append_per_token("token_ids", input_ids)


def context_positions(
    cache: Cache | None, position_ids: torch.Tensor, batch_size: int, config: EGMLAConfig
) -> torch.Tensor:
    """The positions [B, T] of every token whose key is rebuilt (`rope_mode="exact"`): the cached ones and the new
    `position_ids` [B or 1, S], which the cache keeps (left padding makes them differ between rows)."""
    position_ids = position_ids.expand(batch_size, -1)
    if cache is None or not config.caches_positions:
        return position_ids
    return first_latent_layer(cache, "rope_mode='exact' (positions)").append_per_token("positions", position_ids)


def is_latent_cache_layer(layer) -> bool:
    """By layer type, not class: each remote-code copy of this file defines its own class, and the type
    registry keeps the last one imported."""
    return getattr(layer, "_layer_type", None) in (EGMLA_LAYER_TYPE, EGMLA_SLIDING_LAYER_TYPE)


def cache_nbytes(cache: Cache, allocated: bool = False) -> int:
    """Bytes a cache holds for the positions in use: latents, rope keys, token ids, positions (keys and values of
    any other layer). `allocated=True`: the bytes of the storage behind them, spare room included (a static cache's
    whole length; the up to GROWTH_CHUNK - 1 spare positions of a dynamic latent layer)."""
    total, storages = 0, set()
    for layer in cache.layers:
        seen = int(layer.get_seq_length())
        per_token = [(getattr(layer, name), -1) for name in getattr(layer, "PER_TOKEN", ())]
        for tensor, position_dim in [(layer.keys, -2), (layer.values, -2), *per_token]:
            if tensor is None or tensor.numel() == 0:
                continue
            if not allocated:  # the positions in use: all seen, or the window a windowed layer keeps
                length = min(seen, tensor.shape[position_dim])
                total += tensor.numel() // tensor.shape[position_dim] * length * tensor.element_size()
            elif tensor.untyped_storage().data_ptr() not in storages:
                storages.add(tensor.untyped_storage().data_ptr())
                total += tensor.untyped_storage().nbytes()
    return total


# ----------------------------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------------------------


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention: query [B, H, S, dn+dr] over key [B, Hkv, T, dn+dr], value [B, Hkv, T, dv], each key head
    serving `module.num_key_value_groups` query heads."""
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


def causal_mask(query_length: int, key_length: int, device: torch.device) -> torch.Tensor:
    """What a `None` transformers mask means: bool [S, T], query i sits at position key_length - query_length + i."""
    return torch.ones(query_length, key_length, dtype=torch.bool, device=device).tril(key_length - query_length)


def mask_scores(scores: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Applies a transformers mask (bool: True = attend; float: additive; None: causal) to scores [B, H, S, T]."""
    if attention_mask is None:
        query_length, key_length = scores.shape[-2:]
        if query_length == 1:
            return scores
        attention_mask = causal_mask(query_length, key_length, scores.device)
    if attention_mask.dtype == torch.bool:
        return scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    return scores + attention_mask


def latent_sdpa(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    packed: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """The absorbed MQA by SDPA's fused kernel, the cache read once: the query heads become rows of one head over
    the cached rows [latent ; rope key] [B, 1, T, r + dr], which are the values too (their rope-key columns
    dropped after). q_latent [B, H, S, r], q_rope [B, H, S, dr] -> the weighted sum of latents [B, H, S, r]."""
    batch_size, heads, query_length, rank = q_latent.shape
    key_length = packed.shape[2]
    query = torch.cat([q_latent, q_rope], dim=-1).reshape(batch_size, 1, heads * query_length, -1)
    mask = attention_mask  # [B, 1, S, T] or None; with one query, it broadcasts over the heads' rows as it is
    if query_length > 1:
        mask = causal_mask(query_length, key_length, packed.device) if mask is None else mask
        mask = mask.unsqueeze(-3).expand(*mask.shape[:-2], heads, query_length, key_length)
        mask = mask.reshape(*mask.shape[:-3], heads * query_length, key_length)
    output = nn.functional.scaled_dot_product_attention(query, packed, packed, attn_mask=mask, scale=scaling)
    return output[..., :rank].reshape(batch_size, heads, query_length, rank)


class EGMLALayout(NamedTuple):
    """What the attention paths and kernels read of a layer: its heads, dims and settings, fixed when the layer is
    built (`EGMLAAttention.layout`) and carried by every step."""

    num_heads: int  # H
    num_key_value_heads: int  # Hkv: the heads kv_b_proj rebuilds keys and values for, each serving H / Hkv
    rope_key_heads: int  # Hr: each rope key serves H / Hr query heads
    kv_lora_rank: int  # r
    qk_nope_head_dim: int  # dn
    qk_rope_head_dim: int  # dr
    rebuilt_key_dim: int  # dk, the key dims rebuilt from the latent: dn, and in "exact" rope mode dr too
    v_head_dim: int  # dv
    scaling: float
    rope_mode: str  # "decoupled" (a cached rope key) or "exact" (every rebuilt key turned at its position)
    gate_position: str  # "kv" (the rebuilt keys and values) or "latent"
    gate_enabled: bool
    gate_norm: bool  # an RMS norm follows the gate
    norm_eps: float
    key_norm_heads: int  # qk_norm: the key heads whose cached scales multiply the scores (0: no key norm)
    # Decoding can fold W^{UK} into the query and attend over the cached latent itself (MQA): no gate sits between
    # the cache and the keys and no rebuilt key must be turned.
    absorbs: bool

    @classmethod
    def of(cls, config: EGMLAConfig, layer_idx: int) -> "EGMLALayout":
        exact = config.rope_mode == "exact"
        return cls(
            num_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            rope_key_heads=config.rope_key_heads,
            kv_lora_rank=config.layer_kv_lora_rank(layer_idx),
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            rebuilt_key_dim=config.qk_nope_head_dim + (config.qk_rope_head_dim if exact else 0),
            v_head_dim=config.v_head_dim,
            scaling=attention_scaling(config),
            rope_mode=config.rope_mode,
            gate_position=config.gate_position,
            gate_enabled=config.gate_enabled,
            gate_norm=config.gate_enabled and config.gate_norm == "rms",
            norm_eps=config.rms_norm_eps,
            key_norm_heads=config.key_scale_width,
            absorbs=config.absorbs,
        )

    @property
    def num_key_value_groups(self) -> int:
        return self.num_heads // self.num_key_value_heads

    @property
    def gate_on_kv(self) -> bool:
        """A gate multiplies the rebuilt keys and values, after the cache: none of them can be absorbed."""
        return self.gate_enabled and self.gate_position == "kv"

    @property
    def kv_norm(self) -> bool:
        """The gated keys and values are normed (per key head, over dk+dv)."""
        return self.gate_on_kv and self.gate_norm


# The decode contract between this file (also remote code) and attention implementations that read the latent
# cache themselves (egmla.kernels). While decoding, an implementation registered under a name that starts with
# LATENT_DECODE_PREFIX is called as `function(module, None, None, None, attention_mask, step=step)`, reads only the
# EGMLAStep `step` (its layout and weights included, never the module), and returns (output [B, S, H, dv], None), or
# (None, None) to leave the step to the reference path (e.g. a `version` it does not know). Bump the version
# whenever EGMLAStep or EGMLALayout changes.
LATENT_DECODE_PREFIX = "egmla_fused"
LATENT_DECODE_VERSION = 7  # 7: the step carries the key-norm scales (`qk_norm`)


class EGMLAStep(NamedTuple):
    """One attention step of a layer over the latent (cached, or this forward's), built once per forward by
    `build_step` and given to every path: prefill and training, the model's decode paths, and a latent-decode
    implementation's kernels. Read by name."""

    version: int
    layout: EGMLALayout
    q_nope: torch.Tensor  # [B, H, S, dn]
    q_rope: torch.Tensor  # [B, H, S, dr], rotated
    latent: torch.Tensor  # [B, 1, T, r], the whole cache
    rope_key: torch.Tensor  # [B, 1, T, Hr*dr], rotated
    gate_rows: EGMLAGateRows | None  # for gate_position="kv": the gate-table rows of the context's T tokens
    key_rotary: tuple[torch.Tensor, torch.Tensor] | None  # "exact" rope: cos, sin [B, 1, T, dr] of cached positions
    cached_rows: torch.Tensor | None = None  # [B, 1, T, r + Hr*dr (+ Hn)]: latent and rope key side by side, as cached
    key_scale: torch.Tensor | None = None  # qk_norm: [B, 1, T, Hn] each cached key's norm scale, per key head
    # Decoding: the weights the decode multiplies the cache by, the effective ones under an adapter (`kv_weights`).
    kv_weight: torch.Tensor | None = None  # W^{UKV} [Hkv, dk+dv, r]
    gate_weight: torch.Tensor | None = None  # gate on K/V: W^{UE} [Hkv, dk+dv, de]
    norm_weight: torch.Tensor | None = None  # gate on K/V, normed: the norm's weight [dk+dv] (None under a hook)
    uk_weight: torch.Tensor | None = None  # the layer absorbs: W^{UK} [H, dn, r] (`absorbed_weights`)
    uv_weight: torch.Tensor | None = None  # and W^{UV} transposed, [H, r, dv]


def kv_weights(module: "EGMLAAttention", like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W^{UKV} [Hkv, dk+dv, r] and, with the gate on K/V, W^{UE} [Hkv, dk+dv, de]: views of the parameters, or
    where an adapter (LoRA) or accelerate's offload hook acts only when the Linear is called, the projection of
    the identity (the weight it applies), in `like`'s dtype."""
    layout = module.layout
    weights = []
    for linear in (module.kv_b_proj, module.gate_embedding_proj if layout.gate_on_kv else None):
        if linear is None:
            weights.append(None)
            continue
        weight = linear.weight
        if type(linear) not in (nn.Linear, EGMLAGateProjection) or hasattr(linear, "_hf_hook"):
            weight = linear(torch.eye(linear.in_features, device=like.device, dtype=like.dtype)).T
        weights.append(weight.view(layout.num_key_value_heads, layout.rebuilt_key_dim + layout.v_head_dim, -1))
    return weights[0], weights[1]


def absorbed_weights(kv_weight: torch.Tensor, layout: EGMLALayout) -> tuple[torch.Tensor, torch.Tensor]:
    """W^{UK} [H, dn, r] and W^{UV} transposed [H, r, dv], per query head, from W^{UKV} [Hkv, dn+dv, r]: views
    where each key head serves one query head (a converted model's), so a decode step copies no weight; else
    repeated for each key head's group."""
    if layout.num_key_value_groups > 1:
        kv_weight = kv_weight.repeat_interleave(layout.num_key_value_groups, dim=0)  # [H, dn+dv, r]
    uk_weight, uv_weight = kv_weight.split([layout.qk_nope_head_dim, layout.v_head_dim], dim=1)
    return uk_weight, uv_weight.transpose(1, 2)


def build_step(
    module: "EGMLAAttention",
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    rope_key: torch.Tensor,
    gate_rows: EGMLAGateRows | None = None,
    key_rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    cached_rows: torch.Tensor | None = None,
    decoding: bool = False,
    key_scale: torch.Tensor | None = None,
) -> EGMLAStep:
    """The layer's step; decoding, with the weights the decode paths read, made here once per forward (the
    absorbed ones only where the layer absorbs)."""
    layout, weights = module.layout, {}
    if decoding:
        weights["kv_weight"], weights["gate_weight"] = kv_weights(module, like=latent)
        norm = module.gate_norm if layout.kv_norm else None
        if norm is not None and not hasattr(norm, "_hf_hook"):  # a hook moves the weight in only when it is called
            weights["norm_weight"] = norm.weight
        if layout.absorbs:
            weights["uk_weight"], weights["uv_weight"] = absorbed_weights(weights["kv_weight"], layout)
    return EGMLAStep(
        version=LATENT_DECODE_VERSION, layout=layout, q_nope=q_nope, q_rope=q_rope, latent=latent,
        rope_key=rope_key, gate_rows=gate_rows, key_rotary=key_rotary, cached_rows=cached_rows, key_scale=key_scale,
        **weights,
    )  # fmt: skip


class EGMLAAttention(nn.Module):
    """Multi-head latent attention with an embedding gate (design note, section 2).

    Each forward builds one `EGMLAStep` (queries, latent, rope keys, the layer's `layout`, and while decoding the
    weights the decode reads) and hands it to a path. Prefill and training expand the latent to per-head keys and
    values and run the configured attention function (sdpa, eager, ...): `expanded_attention`. Decoding goes
    through `decode_attention`: a fused kernel when the implementation is an `egmla_fused*` one, else with the gate
    off or on the latent the absorbed MQA over the cached `[latent ; rope key]` without any expansion, and with the
    gate on K/V (or RoPE-exact keys) the re-expansion of every cached latent with the gate rebuilt from the cached
    token ids.
    """

    def __init__(self, config: EGMLAConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        # What the attention paths and kernels read of this layer, fixed here; the attributes below repeat it.
        self.layout = layout = EGMLALayout.of(config, layer_idx)
        self.num_heads = layout.num_heads
        self.num_key_value_heads = layout.num_key_value_heads  # the heads kv_b_proj rebuilds keys and values for
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = layout.kv_lora_rank
        self.qk_nope_head_dim = layout.qk_nope_head_dim
        self.qk_rope_head_dim = layout.qk_rope_head_dim
        self.qk_head_dim = config.qk_head_dim
        self.v_head_dim = layout.v_head_dim
        self.rope_key_heads = layout.rope_key_heads
        self.rope_mode = layout.rope_mode
        self.rope_key_width = config.rope_key_width  # cached rope key values per token (0 in "exact" mode)
        self.rebuilt_key_dim = layout.rebuilt_key_dim
        # Which of the F rotary dims each rope key head (and its query group) uses; None = all F, one for all.
        self.rope_dims = rotary_dims(config, layer_idx)
        self.rope_dims_tensor: torch.Tensor | None = None
        self.gate_position = layout.gate_position
        self.absorbs = layout.absorbs
        self.attention_dropout = config.attention_dropout
        self.scaling = layout.scaling
        self.is_causal = True
        self.sliding_window = config.layer_window(layer_idx)  # the model's masks apply it; read by conversion
        self.num_key_value_groups = layout.num_key_value_groups  # query heads per key head (GQA)

        self.key_norm_heads = layout.key_norm_heads
        self.add_query_projections(config)

        self.kv_a_proj_with_mqa = nn.Linear(
            config.hidden_size, self.kv_lora_rank + self.rope_key_width, bias=config.attention_bias
        )
        self.kv_a_layernorm = (
            EGMLARMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps) if config.kv_latent_norm else None
        )
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_key_value_heads * (self.rebuilt_key_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, config.hidden_size, bias=config.attention_bias)

        # W^{UE}: gate embedding -> gate over what it multiplies (per-head K/V, or the latent); starts at zero.
        self.gate_embedding_proj = None
        self.gate_norm = None
        if config.gate_enabled:
            gated_width = (
                self.kv_lora_rank if self.gate_position == "latent" else self.rebuilt_key_dim + self.v_head_dim
            )
            gate_out = gated_width if self.gate_position == "latent" else self.num_key_value_heads * gated_width
            self.gate_embedding_proj = EGMLAGateProjection(config.gate_embedding_dim, gate_out, bias=False)
            if config.gate_norm == "rms":
                self.gate_norm = EGMLARMSNorm(gated_width, eps=config.rms_norm_eps)

    def add_query_projections(self, config: EGMLAConfig) -> None:
        """The query's modules: one projection, a low-rank pair (`q_lora_rank`), or with `qk_norm` the source's
        projection and per-head norm followed by a map per head to `[nope ; rope]`, and the source's key projection,
        of which only each head's norm is kept (cached as a scale per token)."""
        if config.qk_norm:
            norm_dim = config.qk_norm_head_dim
            self.q_proj = nn.Linear(config.hidden_size, self.num_heads * norm_dim, bias=config.attention_bias)
            self.q_norm = EGMLARMSNorm(norm_dim, eps=config.rms_norm_eps)
            self.q_head_proj = EGMLAHeadProjection(self.num_heads, self.qk_head_dim, norm_dim)
            self.k_norm_proj = nn.Linear(config.hidden_size, self.key_norm_heads * norm_dim, bias=config.attention_bias)
        elif config.q_lora_rank is None:
            self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.qk_head_dim, bias=config.attention_bias)
        else:
            self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = EGMLARMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)

    def select_rotary(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, S, F] -> [B, 1, S, dr] (every head alike) or [B, Hr, S, dr] (per rope key head)."""
        if self.rope_dims is None:
            return cos.unsqueeze(1), sin.unsqueeze(1)
        if self.rope_dims_tensor is None or self.rope_dims_tensor.device != cos.device:
            self.rope_dims_tensor = torch.tensor(self.rope_dims, device=cos.device)  # built once per device
        dims = self.rope_dims_tensor
        return cos[..., dims].permute(0, 2, 1, 3), sin[..., dims].permute(0, 2, 1, 3)

    def project_query(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [B, S, D] -> the query [B, H, S, dn+dr], before RoPE."""
        batch_size, seq_length = hidden_states.shape[:-1]
        if self.key_norm_heads:
            query = self.q_proj(hidden_states).view(batch_size, seq_length, self.num_heads, -1)
            return self.q_head_proj(self.q_norm(query))
        if self.q_lora_rank is None:
            query = self.q_proj(hidden_states)
        else:
            query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        return query.view(batch_size, seq_length, self.num_heads, self.qk_head_dim).transpose(1, 2)

    def key_scale(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, S, D] -> [B, 1, S, Hn]: each new key's norm scale, cached beside its rope key."""
        batch_size, seq_length = hidden_states.shape[:-1]
        keys = self.k_norm_proj(hidden_states).view(batch_size, seq_length, self.key_norm_heads, -1)
        return key_norm_scale(keys, self.config.rms_norm_eps).view(batch_size, 1, seq_length, -1)

    def update_cache(
        self, cache: Cache, latent: torch.Tensor, rope_key: torch.Tensor, key_scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Appends the new latents [B, 1, S, r], rope keys and key-norm scales; returns those of the context the cache
        keeps ([B, 1, T, .]; T: a windowed layer's kept positions and the new ones) and its rows side by side."""
        if key_scale is not None:  # cached beside the rope key: [B, 1, S, Hr*dr + Hn]
            rope_key = torch.cat([rope_key, key_scale], dim=-1)
        window = {"sliding_window": self.sliding_window} if self.sliding_window is not None else {}
        latent, rope_key = cache.update(latent, rope_key, self.layer_idx, **window)
        cached_rows = getattr(cache.layers[self.layer_idx], "cached_rows", lambda: None)()
        if key_scale is not None:
            rope_key, key_scale = rope_key.split([self.rope_key_width, self.key_norm_heads], dim=-1)
        return latent, rope_key, key_scale, cached_rows

    def gate(self, states: torch.Tensor, gate_rows: EGMLAGateRows) -> torch.Tensor:
        """states [B, T, W] * (1 + W^{UE} e) [B, T, W], the product computed once per row and gathered."""
        return states * gate_block(1 + self.gate_embedding_proj(gate_rows.rows), gate_rows, 0, gate_rows.length)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        gate_rows: EGMLAGateRows | None = None,
        key_position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """gate_rows: of the whole context [B, T] for `gate_position="kv"`, of the new tokens [B, S] for "latent";
        key_position_embeddings: cos, sin [B, T, F] at every cached token's position ("exact" rope mode)."""
        batch_size, seq_length = hidden_states.shape[:-1]

        query = self.project_query(hidden_states)
        q_nope, q_rope = query.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        latent, rope_key = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.rope_key_width], dim=-1
        )
        if self.kv_a_layernorm is not None:
            latent = self.kv_a_layernorm(latent)
        if self.gate_position == "latent" and self.gate_embedding_proj is not None:
            latent = self.gate(latent, gate_rows)
            if self.gate_norm is not None:
                latent = self.gate_norm(latent)

        cos, sin = self.select_rotary(*position_embeddings)
        q_rope = apply_rotary(q_rope, cos, sin)
        if self.rope_key_width:
            rope_key = rope_key.view(batch_size, seq_length, self.rope_key_heads, self.qk_rope_head_dim)
            rope_key = apply_rotary(rope_key.transpose(1, 2), cos, sin).transpose(1, 2)
        rope_key = rope_key.reshape(batch_size, 1, seq_length, self.rope_key_width)
        latent = latent.view(batch_size, 1, seq_length, self.kv_lora_rank)
        key_rotary = None
        if self.rope_mode == "exact":
            key_rotary = self.select_rotary(*(key_position_embeddings or position_embeddings))

        key_scale = self.key_scale(hidden_states).to(rope_key.dtype) if self.key_norm_heads else None  # [B, 1, S, Hn]
        cached_rows = None
        if cache is not None:
            latent, rope_key, key_scale, cached_rows = self.update_cache(cache, latent, rope_key, key_scale)
            gate_rows, key_rotary = last_positions(latent.shape[2], gate_rows, key_rotary)
        # By shape, not by the cache's length (a tensor in a static cache: comparing it would sync and break graphs).
        # Several new tokens without a mask are a prompt at offset 0 (a static cache's unwritten slots follow it):
        # SDPA's top-left causal mask over the expanded heads is exact there, the decode paths' bottom-right is not.
        decoding = cache is not None and not self.training and latent.shape[2] > seq_length
        decoding = decoding and (seq_length == 1 or attention_mask is not None)
        step = build_step(self, q_nope, q_rope, latent, rope_key, gate_rows=gate_rows, key_rotary=key_rotary,
                          cached_rows=cached_rows, decoding=decoding, key_scale=key_scale)  # fmt: skip
        if decoding:
            attn_output, attn_weights = decode_attention(self, step, attention_mask, **kwargs)
        else:
            attn_output, attn_weights = expanded_attention(self, step, attention_mask, **kwargs)
        attn_output = self.o_proj(attn_output.reshape(batch_size, seq_length, -1))
        return attn_output, attn_weights


def last_positions(
    length: int, gate_rows: EGMLAGateRows | None, key_rotary: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[EGMLAGateRows | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """The whole context's gate rows and key rotations cut to the last `length` positions: those a windowed layer's
    cache kept."""
    if gate_rows is not None and gate_rows.length > length:
        if gate_rows.index is None:  # one row per position: [B*T, de] -> the last `length` of each sequence
            rows = gate_rows.rows.view(gate_rows.batch_size, gate_rows.length, -1)[:, -length:].flatten(0, 1)
            gate_rows = EGMLAGateRows(rows, None, gate_rows.batch_size, length)
        else:
            gate_rows = EGMLAGateRows(gate_rows.rows, gate_rows.index[:, -length:], gate_rows.batch_size, length)
    if key_rotary is not None and key_rotary[0].shape[2] > length:
        key_rotary = tuple(part[:, :, -length:] for part in key_rotary)
    return gate_rows, key_rotary


# ----------------------------------------------------------------------------------------------------------------
# Attention paths: the algorithms over the latent, as functions of the step (and of the layer where its modules
# are called: the expansion, and the attention implementation's function)
# ----------------------------------------------------------------------------------------------------------------


def expand_kv(
    module: "EGMLAAttention",
    latent: torch.Tensor,
    rope_key: torch.Tensor,
    gate_rows: EGMLAGateRows | None,
    key_rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [B, 1, T, r], rope_key [B, 1, T, Hr*dr] -> key [B, Hkv, T, dn+dr], value [B, Hkv, T, dv].

    In "exact" mode the rope dims come from the latent too, rotated by `key_rotary` (cos, sin of every cached
    token's position, [B, 1, T, dr]); with `key_scale` [B, 1, T, Hn] (`qk_norm`) each key is multiplied by its
    norm's scale."""
    key, value = expand_keys_and_values(module, latent, rope_key, gate_rows, key_rotary)
    if key_scale is not None:
        key = key * key_scale_per_head(key_scale, key.shape[1]).unsqueeze(-1).to(key.dtype)
    return key, value


def key_scale_per_head(key_scale: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, 1, T, Hn] -> [B, heads, T]: each of `heads` takes its key-norm head's scale."""
    return key_scale[:, 0].transpose(1, 2).repeat_interleave(heads // key_scale.shape[-1], dim=1)


def expand_keys_and_values(
    module: "EGMLAAttention",
    latent: torch.Tensor,
    rope_key: torch.Tensor,
    gate_rows: EGMLAGateRows | None,
    key_rotary: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`expand_kv` before the key-norm scales."""
    layout = module.layout
    batch_size, _, seq_length, _ = latent.shape
    kv = module.kv_b_proj(latent[:, 0])  # [B, T, Hkv*(dk+dv)], dk = rebuilt key dims; called: adapters act
    if layout.gate_on_kv:
        kv = kv * gate_block(1 + module.gate_embedding_proj(gate_rows.rows), gate_rows, 0, seq_length)
    kv = kv.view(batch_size, seq_length, layout.num_key_value_heads, layout.rebuilt_key_dim + layout.v_head_dim)
    if layout.kv_norm:
        kv = module.gate_norm(kv)
    key, value = kv.transpose(1, 2).split([layout.rebuilt_key_dim, layout.v_head_dim], dim=-1)
    if layout.rope_mode == "exact":
        return rotate_key(layout, key, key_rotary), value
    k_rope = rope_key.view(batch_size, seq_length, layout.rope_key_heads, layout.qk_rope_head_dim).transpose(1, 2)
    k_rope = k_rope.repeat_interleave(layout.num_key_value_heads // layout.rope_key_heads, dim=1)  # [B, Hkv, T, dr]
    return torch.cat([key, k_rope], dim=-1), value


def expanded_attention(
    module: "EGMLAAttention",
    step: EGMLAStep,
    attention_mask: torch.Tensor | None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The configured attention function (sdpa, eager, ...) over per-head keys and values expanded from the
    latent: prefill, training, and decoding that cannot absorb."""
    key, value = expand_kv(module, step.latent, step.rope_key, step.gate_rows, step.key_rotary, step.key_scale)
    implementation = module.config._attn_implementation
    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
    padding = key.shape[-1] - value.shape[-1]
    if padding > 0 and (implementation == "sdpa" or implementation.startswith(LATENT_DECODE_PREFIX)):
        # SDPA's fused kernels need equal key and value widths (else its slow math path runs): zero-pad the
        # values, and drop the zero outputs.
        value = nn.functional.pad(value, (0, padding))
    attn_output, attn_weights = attention_interface(
        module,
        torch.cat([step.q_nope, step.q_rope], dim=-1),
        key,
        value,
        attention_mask,
        dropout=0.0 if not module.training else module.attention_dropout,
        scaling=step.layout.scaling,
        **kwargs,
    )
    return attn_output[..., : step.layout.v_head_dim], attn_weights


def decode_attention(
    module: "EGMLAAttention",
    step: EGMLAStep,
    attention_mask: torch.Tensor | None,
    **kwargs: Unpack[TransformersKwargs],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """New queries [B, H, S, .] over the whole cache, by the first path that applies: a latent-decode kernel of
    the attention implementation (`egmla_fused*`, see the contract above), the absorbed MQA (gate off or on the
    latent, decoupled rope), or the re-expansion of every cached latent (gate on K/V: the paper's form allows
    no absorption; "exact" rope: every rebuilt key is rotated)."""
    implementation = module.config._attn_implementation
    if implementation.startswith(LATENT_DECODE_PREFIX):
        output, _ = ALL_ATTENTION_FUNCTIONS[implementation](module, None, None, None, attention_mask, step=step)
        if output is not None:
            return output, None
    need_weights = implementation == "eager" or bool(kwargs.get("output_attentions"))
    if step.layout.absorbs:
        return absorbed_attention(step, attention_mask, need_weights)
    # The attention weights where asked for; and the expansion calls the gate norm, which an offload hook holds.
    if need_weights or (step.layout.kv_norm and step.norm_weight is None):
        return expanded_attention(module, step, attention_mask, **kwargs)
    return blocked_attention(step, attention_mask)


def absorbed_attention(
    step: EGMLAStep, attention_mask: torch.Tensor | None, need_weights: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MQA over the cached latent (W^{UK} folded into the query, W^{UV} applied after the weighted sum): where the
    cache keeps the rows `[latent ; rope key]` side by side and one rope key serves every head, by SDPA over them,
    or with key-norm scales by one product over them; else (or for the attention weights) by batched products.

    Returns the output [B, S, H, dv] and the attention weights [B, H, S, T] (None from SDPA).
    """
    layout = step.layout
    batch_size, heads, query_length, _ = step.q_nope.shape
    q_nope = step.q_nope.transpose(0, 1).reshape(heads, batch_size * query_length, -1)
    q_latent = torch.bmm(q_nope, step.uk_weight).view(heads, batch_size, query_length, -1).transpose(0, 1)
    rows = step.cached_rows if step.rope_key.shape[-1] and not need_weights and layout.rope_key_heads == 1 else None
    if rows is not None and step.key_scale is None:  # one SDPA call: no key-norm scale multiplies the scores
        out_latent, probs = latent_sdpa(q_latent, step.q_rope, rows, attention_mask, layout.scaling), None
    else:
        keys = (step.latent, step.rope_key, step.key_scale)
        out_latent, probs = latent_attention(layout, q_latent, step.q_rope, keys, attention_mask, rows)
    out_latent = out_latent.transpose(0, 1).reshape(heads, batch_size * query_length, -1)
    # W^{UV} [H, dv, r] as it lies times the latents' columns: a bfloat16 product copies a transposed operand.
    output = torch.bmm(step.uv_weight.mT, out_latent.mT).mT  # [H, B*S, dv]
    return output.view(heads, batch_size, query_length, -1).permute(1, 2, 0, 3), probs


def latent_attention(
    layout: EGMLALayout,
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    attention_mask: torch.Tensor | None,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of (q_latent . latent + q_rope . rope key) x key scale over the cache (`keys`: the latent
    [B, 1, T, r], the rope key [B, 1, T, Hr*dr], the key-norm scales [B, 1, T, Hn] or None; `rows`: the cached
    rows [latent ; rope key ; ...] [B, 1, T, .] where the cache keeps them side by side and one rope key serves every
    head): q_latent [B, H, S, r] -> the weighted sum of latents [B, H, S, r] and the weights [B, H, S, T] (no
    dropout: a layer decodes in eval mode only)."""
    latent, rope_key, key_scale = keys
    batch_size, heads, query_length, rank = q_latent.shape
    key_length = latent.shape[2]
    latent = latent[:, 0]  # [B, T, r], shared by every head
    # The query heads fold into the rows (or columns) of one product, so no head copies the latent; the scale goes
    # on the queries ([B, H, S, .]), not on the scores ([B, H, S, T]).
    if rows is not None:  # as they lie: a bf16 product on the CPU copies a transposed slice of wider rows, each step
        query = torch.cat([q_latent, q_rope], dim=-1) * layout.scaling
        query = query.reshape(batch_size, heads * query_length, -1)
        scores = torch.bmm(rows[:, 0, :, : query.shape[-1]], query.mT).mT  # [B, H*S, T]
    else:  # the rope scores added inside the product
        rope_scores = rope_key_scores(layout, q_rope * layout.scaling, rope_key)  # [B, H, S, T]
        query = (q_latent * layout.scaling).reshape(batch_size, heads * query_length, rank)
        scores = torch.baddbmm(rope_scores.view(batch_size, heads * query_length, key_length), query, latent.mT)
    scores = scores.view(batch_size, heads, query_length, key_length)
    if key_scale is not None:
        scores = scores * key_scale_per_head(key_scale, heads).unsqueeze(2).to(scores.dtype)
    scores = mask_scores(scores, attention_mask)
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q_latent.dtype)
    out_latent = torch.bmm(probs.reshape(batch_size, heads * query_length, key_length), latent)  # [B, H*S, r]
    return out_latent.view(batch_size, heads, query_length, rank), probs


def rope_key_scores(layout: EGMLALayout, q_rope: torch.Tensor, rope_key: torch.Tensor) -> torch.Tensor:
    """q_rope [B, H, S, dr] . rope_key [B, 1, T, Hr*dr] -> [B, H, S, T]: each rope key serves its group of
    query heads, folded into the rows of one batched product (no copy per head)."""
    batch_size, heads, query_length, _ = q_rope.shape
    rope_heads, rope_dim = layout.rope_key_heads, layout.qk_rope_head_dim
    key_length, group = rope_key.shape[2], heads // rope_heads
    if rope_heads == 1:  # one rope key for all heads: the cache is read where it lies, not copied
        q_rope = q_rope.reshape(batch_size, heads * query_length, rope_dim)
        return torch.bmm(q_rope, rope_key[:, 0].mT).view(batch_size, heads, query_length, key_length)
    q_rope = q_rope.reshape(batch_size * rope_heads, group * query_length, rope_dim)
    k_rope = rope_key[:, 0].view(batch_size, key_length, rope_heads, rope_dim)
    k_rope = k_rope.permute(0, 2, 3, 1).reshape(batch_size * rope_heads, rope_dim, -1)
    return torch.bmm(q_rope, k_rope).view(batch_size, heads, query_length, key_length)


def blocked_attention(step: EGMLAStep, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, None]:
    """The re-expansion decode, DECODE_BLOCK cached positions at a time with an online softmax (flash-decoding
    in PyTorch): each block's expanded K/V is used while it is in fast memory, instead of the whole context
    expanded into main memory and read back pass after pass (`egmla bench decode` measures it). Keys are rebuilt
    once per key head (`num_key_value_heads`), its group of query heads attending as rows of one product. Where no
    gate sits on the values (RoPE-exact keys, the gate off or on the latent) only the keys are rebuilt: the weights
    sum the cached latents, and W^{UV} is applied once after. New queries [B, H, S, .] over the cache; returns
    [B, S, H, dv]."""
    layout, latent = step.layout, step.latent
    batch_size, heads, query_length, _ = step.q_nope.shape
    key_length = latent.shape[2]
    fold_norm = folds_gate_norm(step)
    query, rope_scores = blocked_query(step, fold_norm)  # [B, Hkv, M, .], M = the group's heads x S rows
    kv_weight, uv_weight = step.kv_weight, None  # [Hkv, dk+dv, r]
    if not layout.gate_on_kv:  # the weights sum the cached latents themselves
        kv_weight, uv_weight = kv_weight.split([layout.rebuilt_key_dim, layout.v_head_dim], dim=1)
    gate = None  # [U, Hkv*(dk+dv)], once per distinct token; with a row per position, computed block by block
    if layout.gate_on_kv and step.gate_rows.index is not None:
        gate = 1 + gate_product(step, step.gate_rows.rows)
    mask = key_head_mask(attention_mask, layout.num_key_value_groups, query_length, key_length, latent.device)
    width = layout.kv_lora_rank if uv_weight is not None else layout.v_head_dim  # of what the weights sum
    key_scale = None  # qk_norm: [B, Hkv, 1, T] each cached key's norm scale
    if step.key_scale is not None:
        key_scale = key_scale_per_head(step.key_scale, layout.num_key_value_heads).unsqueeze(2).float()
    running = online_softmax_start(query, width)
    for start in range(0, key_length, DECODE_BLOCK):
        end = min(start + DECODE_BLOCK, key_length)
        kv = rebuild_block(step, latent[:, :, start:end], gate_of_block(step, gate, start, end), kv_weight,
                           normed=not fold_norm)  # fmt: skip
        norm_scale = gate_norm_scale(kv, layout.norm_eps).unsqueeze(2) if fold_norm else None  # [B, Hkv, 1, t]
        scores, value = block_scores(step, query, kv, rope_scores, norm_scale, start, end)
        if key_scale is not None:
            scores = scores * key_scale[..., start:end]
        if mask is not None:  # (None: one new token, which sees every cached one)
            scores = mask_scores(scores, mask[..., start:end])
        running = online_softmax_block(running, scores, value, norm_scale)
    _, running_sum, output = running
    output = output / running_sum
    if fold_norm:
        output = output * step.norm_weight[layout.rebuilt_key_dim :]
    if uv_weight is not None:  # [B, Hkv, M, r] -> [B, Hkv, M, dv], per key head
        output = torch.einsum("bgmr,gvr->bgmv", output, uv_weight.float())
    output = output.reshape(batch_size, heads, query_length, -1)  # the rows back to their query heads
    return output.to(step.q_nope.dtype).transpose(1, 2), None


def blocked_query(step: EGMLAStep, fold_norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The queries as each key head's rows [B, Hkv, M, .] and, with decoupled rope, the rope scores [B, Hkv, M, T]
    of every cached position in one product (the rope keys are cached as used); a folded gate norm's key weight
    goes onto the queries."""
    layout, q_nope = step.layout, step.q_nope
    if fold_norm:
        q_nope = q_nope * step.norm_weight[: layout.rebuilt_key_dim]
    if layout.rope_mode == "exact":
        return key_head_rows(torch.cat([q_nope, step.q_rope], dim=-1), layout.num_key_value_heads), None
    rope_scores = rope_key_scores(layout, step.q_rope, step.rope_key)
    return key_head_rows(q_nope, layout.num_key_value_heads), key_head_rows(rope_scores, layout.num_key_value_heads)


def block_scores(
    step: EGMLAStep,
    query: torch.Tensor,
    kv: torch.Tensor,
    rope_scores: torch.Tensor | None,
    norm_scale: torch.Tensor | None,
    start: int,
    end: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scaled float32 scores [B, Hkv, M, t] of cached positions start..end, from their rebuilt rows `kv`, and
    the values they weight: the rebuilt values, or where none are rebuilt the cached latents."""
    layout = step.layout
    if layout.gate_on_kv:
        key, value = kv.split([layout.rebuilt_key_dim, layout.v_head_dim], dim=-1)
    else:
        key, value = kv, step.latent[:, :, start:end]
    if rope_scores is None:  # "exact" rope: the rebuilt rope dims turn with each cached position
        rotary = tuple(part[:, :, start:end] for part in step.key_rotary)
        scores = torch.matmul(query, rotate_key(layout, key, rotary).mT)
    else:
        scores = torch.matmul(query, key.mT)
        scores = (scores if norm_scale is None else scores * norm_scale) + rope_scores[..., start:end]
    return scores.float() * layout.scaling, value


def online_softmax_start(query: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The running maximum and sum [B, Hkv, M, 1] and weighted sum [B, Hkv, M, width] before the first block."""
    batch_size, key_heads, rows, _ = query.shape
    running_max = query.new_full((batch_size, key_heads, rows, 1), float("-inf"), dtype=torch.float32)
    output = query.new_zeros(batch_size, key_heads, rows, width, dtype=torch.float32)
    return running_max, torch.zeros_like(running_max), output


def online_softmax_block(
    running: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scores: torch.Tensor,
    value: torch.Tensor,
    norm_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The running maximum, sum and weighted sum after one more block of scores [B, Hkv, M, t] and values
    [.., t, W]; `norm_scale` (the folded gate norm's) scales the weights, not the sum."""
    running_max, running_sum, output = running
    block_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
    # A row masked out so far keeps -inf as its maximum: its rescale is 1 and its weights 0, not NaN.
    safe_max = block_max.masked_fill(torch.isinf(block_max), 0.0)
    probs = torch.exp(scores - safe_max)
    rescale = torch.exp(running_max - safe_max)
    running_sum = running_sum * rescale + probs.sum(dim=-1, keepdim=True)
    weights = probs if norm_scale is None else probs * norm_scale
    output = output * rescale + torch.matmul(weights.to(value.dtype), value).float()
    return block_max, running_sum, output


def key_head_mask(
    attention_mask: torch.Tensor | None, group: int, query_length: int, key_length: int, device: torch.device
) -> torch.Tensor | None:
    """The mask [.., S, T] as `key_head_rows` lays the queries out, [.., M, T]: the same for every query head of a
    key head's group; causal for several new tokens without one; None for one new token without one."""
    if attention_mask is None and query_length > 1:
        attention_mask = causal_mask(query_length, key_length, device)
    if attention_mask is None:
        return None
    attention_mask = attention_mask.unsqueeze(-3).expand(*attention_mask.shape[:-2], group, query_length, -1)
    return attention_mask.flatten(-3, -2)


def key_head_rows(states: torch.Tensor, key_heads: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, Hkv, (H / Hkv) * S, D]: each key head's group of query heads as rows of one product."""
    batch_size, heads, query_length, width = states.shape
    return states.reshape(batch_size, key_heads, heads // key_heads * query_length, width)


def folds_gate_norm(step: EGMLAStep) -> bool:
    """Whether the blocked decode folds the gate norm's weight into the query (keys) and onto the output
    (values), and its per-position scale into the scores and weights: two passes fewer over each block. Not in
    "exact" rope mode, where the normed keys are turned."""
    return step.layout.rope_mode == "decoupled" and step.norm_weight is not None


def gate_product(step: EGMLAStep, rows: torch.Tensor) -> torch.Tensor:
    """W^{UE} e [.., Hkv*(dk+dv)] of gate-table rows [.., de], by the step's W^{UE}."""
    return nn.functional.linear(rows, step.gate_weight.flatten(0, 1))


def gate_of_block(step: EGMLAStep, gate: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """The gate on K/V [B, t, Hkv*(dk+dv)] of cached positions start..end (None with no gate on K/V)."""
    gate_rows = step.gate_rows
    if gate is not None:
        return gate_block(gate, gate_rows, start, end)
    if not step.layout.gate_on_kv:
        return None
    rows = gate_rows.rows.view(gate_rows.batch_size, gate_rows.length, -1)[:, start:end]
    return 1 + gate_product(step, rows)  # made while the block is used: [B*T, Hkv*(dk+dv)] never is


def rebuild_block(
    step: EGMLAStep, latent: torch.Tensor, gate: torch.Tensor | None, kv_weight: torch.Tensor, normed: bool = True
) -> torch.Tensor:
    """latent [B, 1, t, r] and its gate [B, t, Hkv*(dk+dv)] -> the rebuilt key dims and values [B, Hkv, t, dk+dv],
    gated (and normed), made per key head by one product with W^{UKV} [Hkv, dk+dv, r] (no transpose copy after)."""
    batch_size, _, seq_length, _ = latent.shape
    kv = torch.einsum("btr,hcr->bhtc", latent[:, 0], kv_weight)
    if gate is not None:
        kv = kv * gate.view(batch_size, seq_length, step.layout.num_key_value_heads, -1).transpose(1, 2)
    if normed and step.norm_weight is not None:
        kv = rms_norm(kv, step.norm_weight, step.layout.norm_eps)
    return kv


def gate_norm_scale(kv: torch.Tensor, eps: float) -> torch.Tensor:
    """The gate norm's scale 1 / rms [B, Hkv, t] of each position's gated K/V [B, Hkv, t, dk+dv], in float32."""
    mean_square = torch.linalg.vector_norm(kv.float(), dim=-1).square() / kv.shape[-1]  # one pass, no kv**2
    return torch.rsqrt(mean_square + eps)


def rotate_key(layout: EGMLALayout, key: torch.Tensor, key_rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """ "exact" rope: the rebuilt keys [B, Hkv, t, dn+dr] with their rope dims turned by cos, sin [B, 1, t, dr]."""
    k_nope, k_rope = key.split([layout.qk_nope_head_dim, layout.qk_rope_head_dim], dim=-1)
    return torch.cat([k_nope, apply_rotary(k_rope, *key_rotary)], dim=-1)


class EGMLADecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: EGMLAConfig, layer_idx: int):
        super().__init__()
        self.self_attn = EGMLAAttention(config, layer_idx)
        self.mlp = EGMLAMLP(config)
        self.input_layernorm = EGMLARMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = EGMLARMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_output_norm = self.mlp_output_norm = None  # `sandwich_norms`: on each output (Gemma 3)
        if config.sandwich_norms:
            self.attention_output_norm = EGMLARMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp_output_norm = EGMLARMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        gate_rows: EGMLAGateRows | None = None,
        key_position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            gate_rows=gate_rows,
            key_position_embeddings=key_position_embeddings,
            **kwargs,
        )
        if self.attention_output_norm is not None:
            hidden_states = self.attention_output_norm(hidden_states)
        return self.mlp_block(residual + hidden_states)

    def mlp_block(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The layer after its attention joined the residual stream: the normed MLP, added to it."""
        output = self.mlp(self.post_attention_layernorm(hidden_states))
        if self.mlp_output_norm is not None:
            output = self.mlp_output_norm(output)
        return hidden_states + output


class EGMLAPreTrainedModel(PreTrainedModel):
    config: EGMLAConfig
    config_class = EGMLAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["EGMLADecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False  # flash kernels need equal q/k and v head dims
    _supports_flex_attn = False
    _supports_attention_backend = False  # the latent cache is private to this model
    _can_compile_fullgraph = True  # with the static latent cache (cache_implementation="static")
    _can_record_outputs = {"hidden_states": EGMLADecoderLayer, "attentions": EGMLAAttention}

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """Unless asked otherwise, transformers' default (SDPA for prefill, the absorbed or blocked decode): the path
        the test suite verifies on every device. The fused kernels are opt-in by name (`egmla_fused`), on CUDA too,
        until a GPU run has verified them (docs/decode.md)."""
        if requested_attention is None and torch.cuda.is_available():
            logger.info_once("EG-MLA uses SDPA and the absorbed decode; attn_implementation='egmla_fused' opts in to Triton.")
        return super().get_correct_attn_implementation(requested_attention, is_init_check)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`; with `offload_gate_tables`, the tables end in CPU memory whatever the
        `device_map` said."""
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        for module in model.modules():
            if isinstance(module, EGMLAGateTable):
                module.place_in_cpu_memory()
        return loaded

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`; as remote code the folder maps `AutoModel` to the base model too."""
        if type(self)._auto_class is not None:
            self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}),
                                    "AutoModel": "modeling_egmla.EGMLAModel"}  # fmt: skip
        return super().save_pretrained(save_directory, *args, **kwargs)

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> nn.Embedding:
        """`PreTrainedModel.resize_token_embeddings`, and every gate table with the vocabulary: kept rows stay, new
        rows are zero (the identity gate, 1 + W^{UE} 0), an offloaded table stays in CPU memory."""
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        tables = getattr(self, self.base_model_prefix, self).gate_embeddings
        for index, table in enumerate(tables):
            if table.num_embeddings != embeddings.num_embeddings:
                tables[index] = table.resized(embeddings.num_embeddings)
        return embeddings

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # Leaf modules only: as remote code, modules without parameters of their own are skipped.
        if isinstance(module, EGMLAGateProjection):
            init.zeros_(module.weight)
        elif isinstance(module, EGMLAHeadProjection):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, EGMLAGateTable):
            init.normal_(module.weight, mean=0.0, std=1.0)
        elif isinstance(module, EGMLARotaryEmbedding) and module.rope_theta is not None:  # the base of its own
            inv_freq, _ = module.compute_default_rope_parameters(module.config, rope_theta=module.rope_theta)
            init.copy_(module.inv_freq, inv_freq)
            init.copy_(module.original_inv_freq, inv_freq)
        else:
            super()._init_weights(module)


class EGMLAModel(EGMLAPreTrainedModel):
    _auto_class = "AutoModel"  # saved folders carry this file and an `auto_map` for Hub remote code

    def __init__(self, config: EGMLAConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        # E^{(k)}: one gate table per group of `gate_layers_per_table` layers (none when the gate is off).
        self.gate_embeddings = nn.ModuleList(
            EGMLAGateTable(config.vocab_size, config.gate_embedding_dim, offload=config.offload_gate_tables)
            for _ in range(config.num_gate_tables)
        )
        self.layers = nn.ModuleList(EGMLADecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = EGMLARMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = EGMLARotaryEmbedding(config)
        self.sliding_rotary_emb = None  # the windowed layers' own base (`sliding_rope_theta`)
        if config.sliding_rope_theta is not None:
            self.sliding_rotary_emb = EGMLARotaryEmbedding(config, rope_theta=config.sliding_rope_theta)
        self.gradient_checkpointing = False
        self.post_init()

    def rotary_of(self, layer_idx: int) -> EGMLARotaryEmbedding:
        """The rotary embedding layer `layer_idx` turns its queries and keys with."""
        windowed = self.config.layer_window(layer_idx) is not None
        return self.sliding_rotary_emb if windowed and self.sliding_rotary_emb is not None else self.rotary_emb

    def check_input_ids(self, input_ids: torch.Tensor) -> None:
        """Out-of-range ids would index past the embedding and gate tables: refuse them with a clear error.

        Checked where it costs no host-device sync per decode step: ids on the CPU (reading them is free), and on
        an accelerator every forward of more than one token per row (a prompt: once per `generate` call); a
        one-token step on an accelerator feeds back the model's own token. Never inside a compiled graph."""
        if input_ids.numel() == 0 or torch.compiler.is_compiling():
            return
        if input_ids.device.type != "cpu" and input_ids.shape[-1] == 1:
            return
        low, high = input_ids.min().item(), input_ids.max().item()
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(
                f"input_ids must lie in [0, vocab_size={self.config.vocab_size}); got values from {low} to {high}."
            )

    def check_inputs(
        self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, cache: Cache | None
    ) -> None:
        """What a forward needs, refused by name: exactly one of ids and embeddings, ids for the gate, ids in range
        (`check_input_ids`), and a cache of transformers' kind."""
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if cache is not None and not isinstance(cache, Cache):
            raise TypeError(
                f"cache must be a transformers Cache (EGMLACache(model.config) or DynamicCache(config=model.config)), "
                f"got {type(cache).__name__}: legacy tuples of tensors cannot hold the latent cache."
            )
        if input_ids is not None:
            self.check_input_ids(input_ids)
        elif self.config.gate_enabled:
            raise ValueError("The EG-MLA gate is looked up by token id: pass input_ids, not inputs_embeds.")

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        self.check_inputs(input_ids, inputs_embeds, cache)

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
            if self.config.embedding_multiplier != 1.0:  # in the embeddings' dtype, as Gemma's scaled embedding
                inputs_embeds = inputs_embeds * torch.tensor(self.config.embedding_multiplier, dtype=inputs_embeds.dtype)

        if self.layers[0].gradient_checkpointing and self.training and torch.is_grad_enabled():
            # The checkpointed layers drop the cache: drop it here too, before the gate's token ids are appended.
            cache, use_cache = None, False
        if use_cache and cache is None:
            cache = EGMLACache(self.config)

        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        masks = attention_masks(self.config, inputs_embeds, attention_mask, cache, position_ids)

        gate_rows = []
        if self.config.gate_enabled:  # looked up once, on the distinct tokens, for every layer and path
            gate_rows = look_up_gate_rows(self.gate_embeddings, context_token_ids(cache, input_ids, self.config))

        hidden_states = inputs_embeds
        positions = None  # "exact" rope: every cached token's position [B, T], its keys turned by it
        if self.config.caches_positions and cache is not None:
            positions = context_positions(cache, position_ids, inputs_embeds.shape[0], self.config)
        rotations = {}  # per rotary: cos, sin [B, S, F] of the new tokens, and [B, T, F] of the cached ones
        for windowed, rotary in ((False, self.rotary_emb), (True, self.sliding_rotary_emb)):
            if rotary is not None:
                keys = rotary(hidden_states, position_ids=positions) if positions is not None else None
                rotations[windowed] = (rotary(hidden_states, position_ids=position_ids), keys)
        for layer_idx, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            windowed = self.config.layer_window(layer_idx) is not None
            position_embeddings, key_position_embeddings = rotations.get(windowed, rotations[False])
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=masks[windowed],
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                gate_rows=gate_rows[layer_idx // self.config.gate_layers_per_table] if gate_rows else None,
                key_position_embeddings=key_position_embeddings,
                **kwargs,
            )

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


def attention_masks(
    config: EGMLAConfig,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | dict | None,
    cache: Cache | None,
    position_ids: torch.Tensor,
) -> dict[bool, torch.Tensor | None]:
    """The mask of the full layers (False) and, with windowed layers, of theirs (True); a dict given (by
    `create_masks_for_generate`) is used as it is."""
    if isinstance(attention_mask, dict):
        return attention_mask
    arguments = dict(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
                     position_ids=position_ids)  # fmt: skip
    masks = {False: create_causal_mask(**arguments)}
    if config.sliding_window_layers:
        masks[True] = create_sliding_window_causal_mask(**arguments)
    return masks


class EGMLAForCausalLM(EGMLAPreTrainedModel, GenerationMixin):
    _auto_class = "AutoModelForCausalLM"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: EGMLAConfig):
        super().__init__(config)
        self.model = EGMLAModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @staticmethod
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def create_masks_for_generate(config, inputs_embeds, attention_mask, cache, position_ids=None, **kwargs):
        """The mask `generate` builds before each step over a static cache: the one `EGMLAModel.forward` builds."""
        # The default passes our layer type's 2-D mask through, a position longer every step (a compiled step
        # recompiles); this one is [B, 1, S, max_cache_len] at every step.
        masks = attention_masks(config, inputs_embeds, attention_mask, cache, position_ids)
        return masks if config.sliding_window_layers else masks[False]

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


__all__ = [
    "EGMLACache",
    "EGMLAForCausalLM",
    "EGMLAGateRows",
    "EGMLALatentCacheLayer",
    "EGMLALayout",
    "EGMLAModel",
    "EGMLAPreTrainedModel",
    "EGMLAStep",
    "cache_nbytes",
]
