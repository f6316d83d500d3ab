"""The plugin's attention over vLLM's paged latent cache, for the layouts vLLM's own MLA backends lack (on the CPU
they take only a latent of 512 with a rope key of 64).

On the CPU, absorbed modes run `AbsorbedAttention`, as DeepSeek's MLA: prompts expanded per head, decodes absorbed
(W^{UK} into the query, W^{UV} after) as one MQA over the cached rows. In bf16 and fp16 (`EGMLALatentKernelBackend`)
vLLM's CPU latent-attention kernels (`decode_attention_cpu`, `extend_attention_cpu`, vendored from sglang) run both,
reading the paged cache in place; they take widths that are multiples of 32, so the model pads the cache row with
zero columns (`tail_padding`). In fp32, which those kernels lack (`EGMLACPUMLABackend`), the plugin's own decode
kernel reads the paged cache in place (`cpu_kernels`) and prompts attend by vLLM's CPU attention, its Llama's. The
gate on K/V and the RoPE-exact latent run `RebuildingAttention`; `qk_norm` with the gate off or on the latent runs
`KeyScaledAttention` (every score of a key times its cached norm scale: no latent kernel does it), on a GPU too. On
a GPU, vLLM's own MLA layer, with its MLA backends where the layout is DeepSeek's and this module's PyTorch decode
elsewhere.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm import _custom_ops as ops
from vllm.model_executor.layers.attention import MLAAttention
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata, MLACommonMetadataBuilder
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionLayer, MultipleOf
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa
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


def tail_padding(latent_width: int, tail_width: int, dtype: torch.dtype, pytorch_attention: bool = False) -> int:
    """The zero columns after the cache row's tail that make the row fit vLLM's CPU latent kernels (0 where they do
    not serve: fp32, a GPU, or the plugin's PyTorch attention computing the scores)."""
    if pytorch_attention or not latent_kernels(dtype):
        return 0
    return -(latent_width + tail_width) % LATENT_KERNEL_ALIGNMENT


def latent_backend(
    latent_width: int, tail_width: int, dtype: torch.dtype, pytorch_attention: bool = False
) -> type | None:
    """The attention backend for cached rows [latent ; tail] (the tail padded by `tail_padding`): ours where the
    plugin's PyTorch attention computes the scores (keys rebuilt, or scaled per key: it only writes the cache there)
    and where vLLM has no kernel for that layout, else None (vLLM chooses). On the CPU in bf16 and fp16 ours runs vLLM's latent kernels; elsewhere it is plain PyTorch, so it runs
    on a GPU too, but it is tested on the CPU only."""
    if current_platform.is_cpu():
        return EGMLALatentKernelBackend if not pytorch_attention and latent_kernels(dtype) else EGMLACPUMLABackend
    if pytorch_attention or tail_width != NATIVE_ROPE_WIDTH or latent_width not in NATIVE_LATENT_WIDTHS:
        return EGMLACPUMLABackend
    return None


@dataclass
class EGMLAMLAMetadata(MLACommonMetadata):
    # The whole batch as the scheduler laid it out, for the attentions that read each request's cache themselves
    # (`RebuildingAttention`, `KeyScaledAttention`): [R, blocks], [R], [R + 1].
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


def up_weights(weight: torch.Tensor, heads: int, key_dim: int, value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W^{UK} [H, dk, r] and W^{UV} [H, dv, r], views of W^{UKV} [H * (dk + dv), r] (egmla's `kv_b_proj`)."""
    return weight.view(heads, key_dim + value_dim, -1).split([key_dim, value_dim], dim=1)


class AbsorbedAttention(MLAAttention):
    """vLLM's MLA layer (its cache spec and cache writes) on the CPU, attending as DeepSeek's MLA does. Prompts
    without cached context attend expanded, per head: keys [latent W^{UK} ; rope key] and values latent W^{UV} of
    their own new tokens, the source model's attention (fewer products than the absorbed form when every key is
    new). Decodes, and prompts after cached context, attend absorbed: the query [q_nope W^{UK} ; rope query] as one
    MQA over the cached rows [latent ; rope key], whose first `value_width` columns are the values, the weighted
    latents taken to values by W^{UV} after. In bf16 and fp16 vLLM's CPU latent kernels (`kernels`) run both, reading
    the paged cache in place; in fp32, which they lack, decodes run the plugin's kernel (`mqa_decode`) and prompts
    vLLM's CPU attention (`staged_causal_attention`). Returns the attended values [T, H * dv].
    """

    def __init__(self, rope_key_width: int, kernels: bool, **kwargs):
        super().__init__(**kwargs)
        self.rope_key_width, self.kernels = rope_key_width, kernels
        # The value columns the absorbed attention writes: the latent's, rounded up where vLLM's kernels run.
        self.value_width = latent_value_width(self.kv_lora_rank) if kernels else self.kv_lora_rank

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """W^{UK} [H, dn, r] and W^{UV} [H, value_width, dv] (zero rows past the latent) for the absorbed products,
        from W^{UKV} [H * (dn + dv), r]."""
        weight = self.kv_b_proj.weight.detach().to(act_dtype)
        up_keys, up_values = up_weights(weight, self.num_heads, self.qk_nope_head_dim, self.v_head_dim)
        self.up_keys = up_keys.contiguous()
        padding = (0, 0, 0, self.value_width - weight.shape[-1])
        self.up_values = torch.nn.functional.pad(up_values.transpose(1, 2), padding).contiguous()

    def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, **kwargs) -> torch.Tensor:
        """q [T, H, dn + rope tail] with each head's own nope query; writes output [T, H * dv]."""
        if attn_metadata is None:  # the profile run
            return output.fill_(0)
        tokens, decodes = attn_metadata.num_actual_tokens, attn_metadata.num_decode_tokens
        attended = output[:tokens].view(tokens, self.num_heads, self.v_head_dim)
        if decodes:
            attended[:decodes] = self.up_value(self.decode(self.absorb(q[:decodes]), kv_cache, attn_metadata))
        if tokens > decodes:  # the prompts' new tokens, causal, after their cached context if any
            new_rows = torch.cat([k_c_normed[decodes:tokens], k_pe[decodes:tokens, 0]], dim=-1)  # [N, D]
            if attn_metadata.prefill.chunked_context is None:
                attended[decodes:] = self.expanded_prefill(q[decodes:tokens], new_rows, attn_metadata)
            else:
                query = self.absorb(q[decodes:tokens])
                attended[decodes:] = self.up_value(self.absorbed_prefill(query, new_rows, kv_cache, attn_metadata))
        return output

    def absorb(self, query: torch.Tensor) -> torch.Tensor:
        """[N, H, dn + tail] -> [N, H, r + tail]: each head's nope query taken into the latent by its W^{UK}."""
        nope = self.qk_nope_head_dim
        latent_query = torch.bmm(query[..., :nope].transpose(0, 1), self.up_keys).transpose(0, 1)
        return torch.cat([latent_query, query[..., nope:]], dim=-1)

    def up_value(self, attended: torch.Tensor) -> torch.Tensor:
        """Weighted latents [N, H, value_width] -> values [N, H, dv] by each head's W^{UV}."""
        return torch.bmm(attended.transpose(0, 1), self.up_values).transpose(0, 1)

    def expanded_prefill(self, query: torch.Tensor, new_rows: torch.Tensor, metadata) -> torch.Tensor:
        """Prompts' queries [N, H, dn + tail] over their own new rows [N, r + tail], each head's keys and values
        expanded from the latents. Returns [N, H, dv]."""
        tokens, latent, nope = query.shape[0], self.kv_lora_rank, self.qk_nope_head_dim
        key_nope, value = (
            self.kv_b_proj(new_rows[:, :latent])[0].view(tokens, self.num_heads, -1).split([nope, self.v_head_dim], -1)
        )
        rope_key = new_rows[:, None, latent : latent + self.rope_key_width].expand(-1, self.num_heads, -1)
        key = self.prompt_keys(torch.cat([key_nope, rope_key], dim=-1), new_rows)
        query = query[..., : nope + self.rope_key_width]
        if self.kernels:  # widths in multiples of the kernels' alignment
            key_width, value_width = latent_value_width(key.shape[-1]), latent_value_width(self.v_head_dim)
        else:  # vLLM's CPU attention (and SDPA's fused CPU kernel) takes keys and values of one width
            key_width = value_width = latent_value_width(max(key.shape[-1], self.v_head_dim))
        query, key, value = (
            pad_to(part, width).contiguous()
            for part, width in ((query, key_width), (key, key_width), (value, value_width))
        )
        if not self.kernels:
            starts = metadata.prefill.query_start_loc.to(torch.long)
            window = getattr(self, "sliding_window", None)
            return staged_causal_attention(query, key, value, starts, self.scale, window)[..., : self.v_head_dim]
        # No cached context: the kernel reads only the new keys and values, so they stand in for the cache too.
        return extend_attention(query, key, value, key, value, metadata.prefill, self.scale)[..., : self.v_head_dim]

    def prompt_keys(self, key: torch.Tensor, new_rows: torch.Tensor) -> torch.Tensor:
        """The prompts' expanded keys [N, H, dk] as they are (`KeyScaledAttention` scales them)."""
        return key

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata) -> torch.Tensor:
        """Absorbed queries [B, H, D], one per request, over its cached rows. Returns [B, H, value_width]."""
        if not self.kernels:
            return mqa_decode(query, kv_cache, metadata.decode, self.scale, self.value_width)
        decode, rows = metadata.decode, kv_cache.view(-1, 1, kv_cache.shape[-1])  # [slots, 1, D]
        out = query.new_empty(*query.shape[:2], self.value_width)
        partials = torch.zeros(  # each head's partial sums and log-sum-exp per split of a long context
            query.shape[0], self.num_heads, decode.num_kv_splits, self.value_width + 1, dtype=torch.float32
        )
        torch.ops._C.decode_attention_cpu(
            query, rows, rows[..., : self.value_width], out, None, None, None, partials, decode.req_to_token,
            decode.req_pool_indices, decode.seq_lens_i64, self.scale, 0.0, False, 0, None, None,
        )  # fmt: skip
        return out

    def absorbed_prefill(self, query: torch.Tensor, new_rows: torch.Tensor, kv_cache: torch.Tensor, metadata):
        """Prompts' absorbed queries [N, H, D] over their requests' cached rows, which already hold the new ones.
        Returns [N, H, value_width]."""
        if self.kernels:
            rows, new_rows = kv_cache.view(-1, 1, kv_cache.shape[-1]), new_rows[:, None]  # one key head
            values, new_values = rows[..., : self.value_width], new_rows[..., : self.value_width]
            return extend_attention(query, new_rows, new_values, rows, values, metadata.prefill, self.scale)
        decodes = metadata.num_decodes
        seq_lens = metadata.request_seq_lens[decodes:].to(torch.long)
        starts = metadata.request_query_start_loc[decodes:].to(torch.long)
        rows, valid = request_rows(kv_cache, metadata.request_block_table[decodes:], seq_lens)  # [R, T, D]
        key = rows[:, :, None]  # one key head
        return attend_over_cache(
            query, key, key[..., : self.value_width], valid, seq_lens, starts - starts[0], self.scale
        )


class KeyScaledAttention(AbsorbedAttention):
    """`qk_norm` with the gate off or on the latent: every score of a cached key is multiplied by its key-norm scale
    (cached after the rope keys, one per key-norm head; query head i takes head i // (H / Hn), its key head's), which
    vLLM's latent kernels cannot do. A scaled key times the query is the scaled score: exact. A model with windowed
    layers runs here too, `key_norm_heads` 0 without `qk_norm` (the rows unscaled), each windowed layer within its
    `sliding_window` (vLLM's latent kernels apply none). On the CPU, decodes run the plugin's paged kernel, which
    multiplies the scales into the scores (`paged_decode`), and prompts with no cached context attend expanded, each
    head's key rebuilt and scaled, by vLLM's CPU attention (`expanded_prefill`). Elsewhere, and for prompts after a
    cached context, each query [q_nope W^{UK} ; rope query] attends over its request's cached rows [latent ; rope
    keys] times their scales (made per step, never cached), the values the latents, taken to values by W^{UV} after
    (`attend`). Returns the attended values [T, H * dv].
    """

    def __init__(self, rope_key_width: int, key_norm_heads: int, sliding_window: int | None = None, **kwargs):
        super().__init__(rope_key_width, kernels=False, **kwargs)
        self.key_norm_heads, self.sliding_window = key_norm_heads, sliding_window

    def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, **kwargs) -> torch.Tensor:
        """q [T, H, dn + tail], rotated; the new tokens' rows are already in kv_cache. On the CPU, decodes (one new
        token each, first in the batch) run the plugin's kernel over the paged cache in place; the rest attend here."""
        if attn_metadata is None:  # the profile run
            return output.fill_(0)
        tokens = attn_metadata.num_actual_tokens
        requests = attn_metadata.num_decodes if self.decodes_by_kernel(kv_cache, attn_metadata) else 0
        attended = output[:tokens].view(tokens, self.num_heads, self.v_head_dim)
        if requests:
            attended[:requests] = self.up_value(self.paged_decode(q[:requests], kv_cache, attn_metadata))
        if tokens > requests and self.prompts_expanded(kv_cache, attn_metadata, requests):
            new_rows = torch.cat([k_c_normed[requests:tokens], k_pe[requests:tokens, 0]], dim=-1)  # [N, D]
            attended[requests:] = self.expanded_prefill(q[requests:tokens], new_rows, attn_metadata)
        elif tokens > requests:
            attended[requests:] = self.up_value(self.attend(q[requests:tokens], kv_cache, attn_metadata, requests))
        return output

    def prompts_expanded(self, kv_cache: torch.Tensor, metadata, decodes: int) -> bool:
        """Whether the batch's prompts attend expanded (`expanded_prefill`, vLLM's CPU attention over each head's
        scaled keys): on the CPU, no prompt after a cached context, the decodes taken apart (`decodes_by_kernel`)."""
        if kv_cache.device.type != "cpu" or getattr(metadata, "prefill", None) is None:
            return False
        starts = metadata.request_query_start_loc[decodes:]
        fresh = torch.equal(metadata.request_seq_lens[decodes:].long(), (starts[1:] - starts[:-1]).long())
        return fresh and decodes == metadata.num_decode_tokens  # each prompt's new tokens are its whole sequence

    def prompt_keys(self, key: torch.Tensor, new_rows: torch.Tensor) -> torch.Tensor:
        """Each head's expanded key [N, H, dk] times its key-norm head's scale (cached after the rope keys)."""
        if not self.key_norm_heads:
            return key
        first = self.kv_lora_rank + self.rope_key_width
        scales = new_rows[:, first : first + self.key_norm_heads]
        return key * scales.repeat_interleave(self.num_heads // self.key_norm_heads, dim=-1)[..., None]

    def decodes_by_kernel(self, kv_cache: torch.Tensor, metadata) -> bool:
        """Whether the batch's decodes run the plugin's paged kernel: on the CPU, one new token each."""
        decodes = getattr(metadata, "num_decodes", 0)
        return kv_cache.device.type == "cpu" and decodes > 0 and metadata.num_decode_tokens == decodes

    def paged_decode(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata) -> torch.Tensor:
        """One new token per request [B, H, dn + tail] over its cached rows, each score times its key-norm scale, a
        windowed layer over its window's rows only; [B, H, r]. The PyTorch path where the kernel did not build."""
        key_width = self.kv_lora_rank + self.rope_key_width
        absorbed = self.absorb(query)[..., :key_width].float().contiguous()
        out = absorbed.new_empty(*absorbed.shape[:2], self.kv_lora_rank)
        requests = query.shape[0]
        table, seq_lens = metadata.request_block_table[:requests], metadata.request_seq_lens[:requests]
        scales = {"scale_column": key_width, "scale_heads": self.key_norm_heads} if self.key_norm_heads else {}
        if paged_latent_decode(absorbed, kv_cache, table, seq_lens, self.scale, out, **scales,
                               window=self.sliding_window or 0):  # fmt: skip
            return out.to(query.dtype)
        return self.attend(query, kv_cache, metadata, 0, requests)

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata, first: int, requests: int | None = None):
        """New tokens [N, H, dn + tail] of the batch's requests from `first` (`requests` of them: all the rest) over
        their cached rows, causal within the new tokens; [N, H, r]."""
        last = None if requests is None else first + requests
        seq_lens = metadata.request_seq_lens[first:last].to(torch.long)
        starts = metadata.request_query_start_loc[first : None if last is None else last + 1].to(torch.long)
        rows, valid = request_rows(kv_cache, metadata.request_block_table[first:last], seq_lens)  # [R, T, width]
        key = self.scaled_keys(rows)  # [R, T, Hn, r + rope]
        absorbed = self.absorb(query)[..., : key.shape[-1]]  # the scale columns' zeros dropped
        value = rows[:, :, None, : self.kv_lora_rank]  # [R, T, 1, r]
        return attend_over_cache(absorbed, key, value, valid, seq_lens, starts - starts[0], self.scale,
                                 self.sliding_window)  # fmt: skip

    def scaled_keys(self, rows: torch.Tensor) -> torch.Tensor:
        """Cached rows [R, T, r + rope + Hn (+ ...)] -> keys [R, T, Hn, r + rope]: [latent ; rope keys] times each
        key-norm head's scale."""
        key_width = self.kv_lora_rank + self.rope_key_width
        if not self.key_norm_heads:  # no qk_norm (a windowed model): one key, the row itself
            return rows[:, :, None, :key_width]
        scales = rows[..., key_width : key_width + self.key_norm_heads]
        return rows[:, :, None, :key_width] * scales[..., None]


def extend_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    prefill, scale: float,
) -> torch.Tensor:  # fmt: skip
    """vLLM's CPU latent kernel for prompts: queries [N, H, dk] over their new keys and values [N, Hkv, dk or dv]
    after their cached context in key_cache and value_cache (rows by `prefill.req_to_token`), causal. Returns
    [N, H, dv]."""
    out = value.new_empty(*query.shape[:2], value.shape[-1])
    torch.ops._C.extend_attention_cpu(
        query, key, value, out, key_cache, value_cache, prefill.req_to_token, prefill.req_pool_indices,
        prefill.cpu_seq_lens, prefill.extend_seq_lens, prefill.extend_start_loc, prefill.max_len_extend, scale, 0.0,
        False, 0, None, None, None,
    )  # fmt: skip
    return out


def pad_to(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Zero columns after the last dim's own up to `width` (zeros add nothing to a score or a weighted sum)."""
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1])) if tensor.shape[-1] < width else tensor


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


# The block size of the scratch cache prompts' keys and values are staged through for vLLM's CPU attention.
SCRATCH_BLOCK_SIZE = 32


def staged_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: torch.Tensor, scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Each prompt's queries [N, H, d] over its own keys and values [N, H, d], causal (within
    `sliding_window` positions where given), by the CPU attention kernel vLLM's own Llama runs (padded with zero
    columns to its next head size), the keys and values staged through a scratch paged cache as vLLM stages encoder
    attention; by SDPA (`causal_attention`) where this vLLM lacks the kernel or the size. Returns [N, H, d]."""
    widths = [size for size in CPUAttentionBackend.get_supported_head_sizes() if size >= key.shape[-1]]
    if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache") or not widths:
        return causal_attention(query, key, value, starts, scale, sliding_window)
    if min(widths) > key.shape[-1]:  # the kernel's next head size: zero columns add nothing
        padded = (pad_to(part, min(widths)) for part in (query, key, value))
        return staged_causal_attention(*padded, starts, scale, sliding_window)[..., : key.shape[-1]]
    window = -1 if sliding_window is None else sliding_window
    tokens, heads, width = key.shape
    lengths = starts[1:] - starts[:-1]
    blocks = -(-lengths // SCRATCH_BLOCK_SIZE)  # each request's own, one after another
    first_block = torch.cumsum(blocks, 0) - blocks
    block_table = first_block[:, None] + torch.arange(int(blocks.max()))[None]  # past a request's own: never read
    request = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    slots = first_block[request] * SCRATCH_BLOCK_SIZE + torch.arange(tokens) - starts[request]
    cache = key.new_zeros(int(blocks.sum()), heads, 2 * SCRATCH_BLOCK_SIZE, width)  # as vLLM: a block is read whole
    key_cache, value_cache = cache.chunk(2, dim=2)
    isa = _get_attn_isa(key.dtype, SCRATCH_BLOCK_SIZE, width)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    starts, lengths = starts.to(torch.int32), lengths.to(torch.int32)
    schedule = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(lengths), num_heads=heads, num_kv_heads=heads, head_dim=width, seq_lens=lengths,
        dtype=key.dtype, query_start_loc=starts, causal=True, sliding_window_size=window, isa=isa,
        enable_kv_split=False,
    )  # fmt: skip
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
        seq_lens=lengths, scale=scale, causal=True, alibi_slopes=None, sliding_window=window,
        block_table=block_table.to(torch.int32), softcap=0.0, scheduler_metadata=schedule, s_aux=None,
    )  # fmt: skip
    return out


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: torch.Tensor, scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Each prompt's queries [N, H, d] over its own keys and values [N, Hkv, d], causal (within `sliding_window`
    positions where given): prompts of one length as they are, others padded to the longest with a mask. Returns
    [N, H, d]."""
    lengths = starts[1:] - starts[:-1]
    gqa = key.shape[1] != query.shape[1]
    if sliding_window is None and bool((lengths == lengths[0]).all()):
        query, key, value = (
            part.view(len(lengths), -1, *part.shape[1:]).transpose(1, 2) for part in (query, key, value)
        )
        attended = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=gqa
        )
        return attended.transpose(1, 2).flatten(0, 1)
    padded, request, place = padded_queries(query, starts)  # [R, S, H, d]
    key, value = (padded_queries(part, starts)[0] for part in (key, value))  # [R, S, Hkv, d]
    positions = torch.arange(padded.shape[1], device=query.device)
    mask = (positions[None, None, :] <= positions[None, :, None]) & (positions[None, None, :] < lengths[:, None, None])
    if sliding_window is not None:
        mask &= positions[None, None, :] > positions[None, :, None] - sliding_window
    attended = torch.nn.functional.scaled_dot_product_attention(
        padded.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask[:, None], scale=scale,
        enable_gqa=gqa,
    )  # fmt: skip
    return attended.transpose(1, 2)[request, place]


def attend_over_cache(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, seq_lens: torch.Tensor,
    starts: torch.Tensor, scale: float, sliding_window: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """New tokens query [N, H, dq] over their requests' cached keys [R, T, Hkv, dq] and values [R, T, Hkv or 1, dv]
    (`valid` [R, T]: which are a request's own), causal within the new tokens (the last of each request's
    `seq_lens`; `starts` [R + 1] splits the queries by request). With `sliding_window` w the query at position i
    sees only the keys at i - w < j <= i (a cached row's position is its slot in the request). Returns
    [N, H, dv]."""
    padded, request, place = padded_queries(query, starts)  # [R, S, H, dq]
    query_lens = (starts[1:] - starts[:-1])[:, None, None]
    positions = torch.arange(key.shape[1], device=key.device)[None, None]
    new_positions = (
        seq_lens[:, None, None] - query_lens + torch.arange(padded.shape[1], device=key.device)[None, :, None]
    )
    mask = (positions <= new_positions) & valid[:, None]  # [R, S, T]
    if sliding_window is not None:
        mask &= positions > new_positions - sliding_window
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

    def __init__(self, rebuild, up_values=None, sliding_window: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.rebuild, self.up_values, self.sliding_window = rebuild, up_values, sliding_window

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
        attended = attend_over_cache(  # [N, H, dv] or [N, H, r]
            query, key, value, valid, seq_lens, starts, self.scale, self.sliding_window
        )
        return attended if self.up_values is None else self.up_values(attended)
