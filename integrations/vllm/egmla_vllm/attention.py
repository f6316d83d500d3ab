"""The plugin's attention over vLLM's paged latent cache, for the layouts vLLM's own MLA backends lack (on the CPU
they take only a latent of 512 with a rope key of 64).

On the CPU, absorbed modes run `AbsorbedAttention`: prompts and decodes alike as one MQA over the cached rows, the
model having folded W^{UK} and W^{UV} into its projections. In bf16 and fp16 (`EGMLALatentKernelBackend`) vLLM's CPU
latent-attention kernels (`decode_attention_cpu`, `extend_attention_cpu`, vendored from sglang) read the paged cache
in place; they take widths that are multiples of 32, so the model pads the cache row with zero columns
(`tail_padding`). In fp32, which those kernels lack (`EGMLACPUMLABackend`), the plugin's own decode kernel reads the
paged cache in place (`cpu_kernels`) and prompts attend by PyTorch's SDPA. The gate on K/V and the
RoPE-exact latent run `RebuildingAttention`. On a GPU, vLLM's own MLA layer, with its MLA backends where the layout is
DeepSeek's and this module's PyTorch decode elsewhere.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.model_executor.layers.attention import MLAAttention
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata, MLACommonMetadataBuilder
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionLayer, MultipleOf
from vllm.v1.attention.backends.mla.amx_mla import AMXMLAMetadataBuilder
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from .cpu_kernels import paged_latent_decode

# The cache rows vLLM's own GPU MLA kernels take: a 64-wide rope key after a latent of 256, 448 or 512 (DeepSeek's
# layouts; its MLA metadata checks the sum, 320, 512 or 576).
NATIVE_ROPE_WIDTH = 64
NATIVE_LATENT_WIDTHS = (256, 448, 512)


# vLLM's CPU latent kernels take a cached row and a value (its first columns) whose widths are multiples of this.
LATENT_KERNEL_ALIGNMENT = 32


def latent_kernels(dtype: torch.dtype) -> bool:
    """Whether vLLM's CPU latent-attention kernels serve this dtype here (they have no fp32)."""
    return (
        current_platform.is_cpu()
        and dtype in (torch.bfloat16, torch.float16)
        and hasattr(torch.ops._C, "decode_attention_cpu")
        and hasattr(torch.ops._C, "extend_attention_cpu")
    )


def latent_value_width(latent_width: int) -> int:
    """The value columns vLLM's CPU latent kernels read and write: the latent's, rounded up to their alignment."""
    return -(-latent_width // LATENT_KERNEL_ALIGNMENT) * LATENT_KERNEL_ALIGNMENT


def tail_padding(latent_width: int, tail_width: int, dtype: torch.dtype, rebuilds: bool = False) -> int:
    """The zero columns after the cache row's tail that make the row fit vLLM's CPU latent kernels (0 where they do
    not serve: fp32, a GPU, or keys rebuilt from the cache)."""
    if rebuilds or not latent_kernels(dtype):
        return 0
    return -(latent_width + tail_width) % LATENT_KERNEL_ALIGNMENT


def latent_backend(latent_width: int, tail_width: int, dtype: torch.dtype, rebuilds: bool = False) -> type | None:
    """The attention backend for cached rows [latent ; tail] (the tail padded by `tail_padding`): ours where the keys
    are rebuilt (it only writes the cache there) and where vLLM has no kernel for that layout, else None (vLLM
    chooses). On the CPU in bf16 and fp16 ours runs vLLM's latent kernels; elsewhere it is plain PyTorch, so it runs
    on a GPU too, but it is tested on the CPU only."""
    if current_platform.is_cpu():
        return EGMLALatentKernelBackend if not rebuilds and latent_kernels(dtype) else EGMLACPUMLABackend
    if rebuilds or tail_width != NATIVE_ROPE_WIDTH or latent_width not in NATIVE_LATENT_WIDTHS:
        return EGMLACPUMLABackend
    return None


@dataclass
class EGMLAMLAMetadata(MLACommonMetadata):
    # The whole batch as the scheduler laid it out, for the gate on K/V (`GatedKVAttention`), which attends every
    # new token over its request's cache in one pass: [R, blocks], [R], [R + 1].
    request_block_table: torch.Tensor | None = None
    request_seq_lens: torch.Tensor | None = None
    request_query_start_loc: torch.Tensor | None = None

    def __post_init__(self):  # vLLM's check lists the head sizes its kernels take; the decodes here take any
        pass


class EGMLAMLAMetadataBuilder(MLACommonMetadataBuilder[EGMLAMLAMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **kwargs):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, metadata_cls=EGMLAMLAMetadata, **kwargs)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> EGMLAMLAMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata.request_block_table = common_attn_metadata.block_table_tensor
        metadata.request_seq_lens = common_attn_metadata.seq_lens
        metadata.request_query_start_loc = common_attn_metadata.query_start_loc
        return metadata


class EGMLACPUMLABackend(CPUMLABackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size % 16 == 0

    @staticmethod
    def get_builder_cls() -> type[EGMLAMLAMetadataBuilder]:
        return EGMLAMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type["EGMLACPUMLAImpl"]:
        return EGMLACPUMLAImpl


class EGMLACPUMLAImpl(CPUMLAImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # At its own head count, vLLM's MLA layer writes W^{UK}'s product into a contiguous buffer, not a transposed view.
        self.q_pad_num_heads = self.num_heads

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale) -> None:
        """The new tokens' rows [latent ; tail] written to their slots in one copy (slot -1: padding, skipped)."""
        if kv_cache.numel() == 0:
            return
        rows = torch.cat([kv_c_normed, k_pe.flatten(1)], dim=-1).to(kv_cache.dtype)
        slots = slot_mapping.flatten().to(torch.long)
        if bool((slots < 0).any()):
            rows, slots = rows[slots >= 0], slots[slots >= 0]
        kv_cache.view(-1, rows.shape[-1]).index_copy_(0, slots, rows)

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: MLACommonMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, None]:
        """One new token per request: q [B, H, r + dr] (W^{UK} absorbed) over each request's cached rows
        [latent ; rope key], gathered from the paged cache by its block table. Returns the attended latent
        [B, H, r]."""
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        attended = mqa_decode(q, kv_c_and_k_pe_cache, attn_metadata.decode, self.scale, self.kv_lora_rank)
        return attended.to(q.dtype), None


class EGMLALatentKernelMetadataBuilder(EGMLAMLAMetadataBuilder, AMXMLAMetadataBuilder):
    """Our metadata with what vLLM's CPU latent kernels take, computed once per step (vLLM's AMX MLA builder): each
    request's flat cache rows (`req_to_token`), int64 lengths, and the decode's split of long contexts."""


class EGMLALatentKernelBackend(EGMLACPUMLABackend):
    """The cache and its writes as `EGMLACPUMLABackend`, the metadata for vLLM's CPU latent kernels
    (`AbsorbedAttention` runs them)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16]

    @staticmethod
    def get_builder_cls() -> type[EGMLALatentKernelMetadataBuilder]:
        return EGMLALatentKernelMetadataBuilder


class AbsorbedAttention(MLAAttention):
    """vLLM's MLA layer (its cache spec and cache writes) on the CPU for queries the model has already absorbed:
    W^{UK} is in the query's projection and W^{UV} in the output's, so every new token, in a prompt or a decode,
    attends over its request's cached rows as one MQA: the query [T, H, D] = [q W^{UK} ; rope query ; zeros] meets
    rows [latent ; rope key ; zeros], whose first `value_width` columns are the values (the latent, then columns the
    output's projection gives zero weight). In bf16 and fp16 vLLM's CPU latent kernels read the paged cache in place
    (`kernels`); in fp32 (which they lack) decodes by the plugin's kernel reading the cache in place
    (`mqa_decode`), prompts by PyTorch's SDPA over their own new rows (with cached context, over their requests'
    rows gathered from the cache). Returns the attended rows
    [T, H * value_width].
    """

    def __init__(self, value_width: int, kernels: bool, **kwargs):
        super().__init__(**kwargs)
        self.value_width, self.kernels = value_width, kernels

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Nothing to split: the model folded W^{UKV} into its projections."""

    def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, **kwargs) -> torch.Tensor:
        if attn_metadata is None:  # the profile run
            return output.fill_(0)
        tokens, decodes = attn_metadata.num_actual_tokens, attn_metadata.num_decode_tokens
        attended = output[:tokens].view(tokens, self.num_heads, self.value_width)
        if decodes:
            decode = self.decode_kernel if self.kernels else self.decode_torch
            decode(q[:decodes], kv_cache, attn_metadata, attended[:decodes])
        if tokens > decodes:  # the prompts' new tokens, causal, after their cached context if any
            new_rows = torch.cat([k_c_normed[decodes:tokens], k_pe[decodes:tokens, 0]], dim=-1)  # [N, D]
            prefill = self.prefill_kernel if self.kernels else self.prefill_torch
            prefill(q[decodes:tokens], new_rows, kv_cache, attn_metadata, attended[decodes:])
        return output

    def decode_kernel(self, query, kv_cache, metadata, out) -> None:
        decode, rows = metadata.decode, kv_cache.view(-1, 1, kv_cache.shape[-1])  # [slots, 1, D]
        partials = torch.zeros(  # each head's partial sums and log-sum-exp per split of a long context
            query.shape[0], self.num_heads, decode.num_kv_splits, self.value_width + 1, dtype=torch.float32
        )
        torch.ops._C.decode_attention_cpu(
            query, rows, rows[..., : self.value_width], out, None, None, None, partials, decode.req_to_token,
            decode.req_pool_indices, decode.seq_lens_i64, self.scale, 0.0, False, 0, None, None,
        )  # fmt: skip

    def prefill_kernel(self, query, new_rows, kv_cache, metadata, out) -> None:
        prefill, rows = metadata.prefill, kv_cache.view(-1, 1, kv_cache.shape[-1])
        new_rows = new_rows[:, None]
        torch.ops._C.extend_attention_cpu(
            query, new_rows, new_rows[..., : self.value_width], out, rows, rows[..., : self.value_width],
            prefill.req_to_token, prefill.req_pool_indices, prefill.cpu_seq_lens, prefill.extend_seq_lens,
            prefill.extend_start_loc, prefill.max_len_extend, self.scale, 0.0, False, 0, None, None, None,
        )  # fmt: skip

    def decode_torch(self, query, kv_cache, metadata, out) -> None:
        out.copy_(mqa_decode(query, kv_cache, metadata.decode, self.scale, self.value_width))

    def prefill_torch(self, query, new_rows, kv_cache, metadata, out) -> None:
        """Prompts without cached context attend over their own new rows; with context, over their requests' rows
        in the cache (which already hold the new ones)."""
        decodes = metadata.num_decodes
        if metadata.prefill.chunked_context is None:
            starts = metadata.prefill.query_start_loc.to(torch.long)
            out.copy_(causal_mqa(query, new_rows, starts, self.scale)[..., : self.value_width])
            return
        seq_lens = metadata.request_seq_lens[decodes:].to(torch.long)
        starts = metadata.request_query_start_loc[decodes:].to(torch.long)
        rows, valid = request_rows(kv_cache, metadata.request_block_table[decodes:], seq_lens)  # [R, T, D]
        key = rows[:, :, None]  # one key head
        attended = attend_over_cache(
            query, key, key[..., : self.value_width], valid, seq_lens, starts - starts[0], self.scale
        )
        out.copy_(attended)


def mqa_decode(query: torch.Tensor, kv_cache: torch.Tensor, decode, scale: float, value_width: int) -> torch.Tensor:
    """One new token per request, query [B, H, D], over its cached rows [latent ; tail] (keys, and values in their
    first `value_width` columns). fp32 on the CPU: the plugin's kernel reads the rows in place from the paged cache
    (`cpu_kernels`); elsewhere the rows are gathered by the block table and SDPA's fused kernel reads them once, the
    query heads as rows of one head. Returns [B, H, value_width]."""
    if query.dtype == kv_cache.dtype == torch.float32 and kv_cache.device.type == "cpu":
        out = query.new_empty(*query.shape[:2], value_width)
        if paged_latent_decode(query, kv_cache, decode.block_table, decode.seq_lens, scale, out):
            return out
    rows, valid = request_rows(kv_cache, decode.block_table, decode.seq_lens.to(torch.long))  # [B, T, D], [B, T]
    attended = torch.nn.functional.scaled_dot_product_attention(
        query.to(rows.dtype)[:, None], rows[:, None], rows[:, None], attn_mask=valid[:, None, None], scale=scale
    )  # [B, 1, H, D]
    return attended[:, 0, :, :value_width]


def causal_mqa(query: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, scale: float) -> torch.Tensor:
    """Each prompt's queries [N, H, D] over its own rows [N, D] (keys and values), causal: prompts of one length as
    they are, others padded to the longest with a mask. Returns [N, H, D]."""
    lengths = starts[1:] - starts[:-1]
    if bool((lengths == lengths[0]).all()):
        query, rows = query.view(len(lengths), -1, *query.shape[1:]), rows.view(len(lengths), -1, 1, rows.shape[-1])
        attended = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(1, 2), rows.transpose(1, 2), rows.transpose(1, 2), is_causal=True, scale=scale,
            enable_gqa=True,
        )  # fmt: skip
        return attended.transpose(1, 2).flatten(0, 1)
    padded, request, place = padded_queries(query, starts)  # [R, S, H, D]
    rows = padded_queries(rows[:, None], starts)[0]  # [R, S, 1, D]
    positions = torch.arange(padded.shape[1], device=query.device)
    mask = (positions[None, None, :] <= positions[None, :, None]) & (positions[None, None, :] < lengths[:, None, None])
    attended = torch.nn.functional.scaled_dot_product_attention(
        padded.transpose(1, 2), rows.transpose(1, 2), rows.transpose(1, 2), attn_mask=mask[:, None], scale=scale,
        enable_gqa=True,
    )  # fmt: skip
    return attended.transpose(1, 2)[request, place]


def attend_over_cache(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, seq_lens: torch.Tensor,
    starts: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """New tokens query [N, H, dq] over their requests' cached keys [R, T, Hkv, dq] and values [R, T, Hkv or 1, dv]
    (`valid` [R, T]: which are a request's own), causal within the new tokens (the last of each request's
    `seq_lens`; `starts` [R + 1] splits the queries by request). Returns [N, H, dv]."""
    padded, request, place = padded_queries(query, starts)  # [R, S, H, dq]
    query_lens = (starts[1:] - starts[:-1])[:, None, None]
    positions = torch.arange(key.shape[1], device=key.device)[None, None]
    new_positions = (
        seq_lens[:, None, None] - query_lens + torch.arange(padded.shape[1], device=key.device)[None, :, None]
    )
    mask = (positions <= new_positions) & valid[:, None]  # [R, S, T]
    value = value.expand(-1, -1, key.shape[2], -1)  # one value head (the latents) for every key head, not copied
    attended = torch.nn.functional.scaled_dot_product_attention(
        padded.transpose(1, 2).to(key.dtype), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask[:, None],
        scale=scale, enable_gqa=key.shape[2] != padded.shape[2],  # each key head serves a group of query heads
    )  # fmt: skip
    return attended.transpose(1, 2)[request, place]


def request_rows(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's cached rows [R, T, width], gathered in one pass from the paged cache [blocks, block_size, width]
    by its block table (T: the longest request), and which of them are its own [R, T]. Past a request's length its
    first row stands in: it was written, so it is finite where a reused block may hold anything (NaN included, and
    a masked weight of 0 times NaN is NaN)."""
    block_size, width = kv_cache.shape[-2], kv_cache.shape[-1]
    length = int(seq_lens.max())  # a host sync on a GPU; this backend is the CPU's
    positions = torch.arange(length, device=kv_cache.device)[None]
    valid = positions < seq_lens[:, None]
    positions = torch.where(valid, positions, 0)
    slots = block_table.to(torch.long).gather(1, positions // block_size) * block_size + positions % block_size
    return kv_cache.view(-1, width)[slots], valid


def padded_queries(query: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's new tokens [N, H, d] laid out per request [R, S, H, d] (zeros past a request's own), with each
    token's request and place in it [N]."""
    query_lens = starts[1:] - starts[:-1]
    request = torch.repeat_interleave(torch.arange(len(query_lens), device=query.device), query_lens)
    place = torch.arange(query.shape[0], device=query.device) - starts[request]
    padded = query.new_zeros(len(query_lens), int(query_lens.max()), *query.shape[1:])
    padded[request, place] = query
    return padded, request, place


class RebuildingAttention(MLAAttention):
    """vLLM's MLA layer for what the absorbed decode cannot express, the gate on K/V and the RoPE-exact latent: the
    paged cache row is `[latent ; tail]` (the tail: the rope keys, and the token id as base-256 digits, exact in any
    float dtype, where the gate on K/V needs it), and every step rebuilds each request's keys from its whole cache
    (`rebuild`, the model's: rows [R, T, width] -> keys [R, T, Hkv, dq], one per key head; with the gate on K/V the
    values [R, T, Hkv, dv] too, without it the latents [R, T, 1, r], which the weights sum and `up_values` takes to
    values once after).

    The cache write, its spec (one row per token per layer) and the block tables are vLLM's; only the attention
    (`forward_impl`) is replaced: one pass for prefill and decode alike, every new token over its request's cache.
    """

    def __init__(self, rebuild, up_values=None, **kwargs):
        super().__init__(**kwargs)
        self.rebuild, self.up_values = rebuild, up_values

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Nothing to absorb: W^{UKV} stays whole for `rebuild` (MLAAttention would split it into W^{UK}/W^{UV})."""

    def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, **kwargs) -> torch.Tensor:
        if attn_metadata is None:  # the profile run
            return output.fill_(0)
        tokens = attn_metadata.num_actual_tokens
        attended = self.attend(q[:tokens], kv_cache, attn_metadata)  # [N, H, dv]
        output[:tokens] = attended.flatten(1).to(output.dtype)
        return output

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: EGMLAMLAMetadata) -> torch.Tensor:
        """query [N, H, dq], rotated, over each request's cache; causal within the new tokens."""
        seq_lens = metadata.request_seq_lens.to(torch.long)
        starts = metadata.request_query_start_loc.to(torch.long)
        rows, valid = request_rows(kv_cache, metadata.request_block_table, seq_lens)  # [R, T, width], [R, T]
        key, value = self.rebuild(rows)
        attended = attend_over_cache(query, key, value, valid, seq_lens, starts, self.scale)  # [N, H, dv] or [N, H, r]
        return attended if self.up_values is None else self.up_values(attended)
