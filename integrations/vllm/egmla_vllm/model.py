"""EG-MLA (gate off, or on the latent) as a vLLM model over vLLM's MLA attention layer.

The paged cache holds one row `[latent ; rope keys]` per token per layer, as DeepSeek's does: the gate on the latent
is applied before the attention layer, and the rope is applied here (egmla picks each rope key head's frequencies),
so vLLM's `MLAAttention` sees a plain MLA. Weights load by name from the egmla checkpoint unchanged.
"""

import math
from collections.abc import Iterable

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, VllmConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
from vllm.model_executor.layers.attention import MLAAttention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors

from .attention import (
    AbsorbedAttention,
    KeyScaledAttention,
    RebuildingAttention,
    latent_backend,
    latent_kernels,
    tail_padding,
    up_weights,
)
from .config import EGMLAConfig


def attention_scaling(config: EGMLAConfig) -> float:
    """1/sqrt(qk head dim), times DeepSeek's YaRN mscale^2 when `mscale_all_dim` is set (as egmla)."""
    scaling = config.qk_head_dim**-0.5
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scaling = scaling * mscale * mscale
    return scaling


class EGMLARotary(nn.Module):
    """cos, sin [T, F] of the F = `head_dim` rotary dims at each position (transformers' rope utilities).
    `rope_theta`: a default-type rotary of that base instead of the config's (the windowed layers',
    `sliding_rope_theta`)."""

    def __init__(self, config: EGMLAConfig, rope_theta: float | None = None):
        super().__init__()
        rope = config.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}
        if rope_theta is not None:
            rope = {"rope_type": "default", "rope_theta": rope_theta}
        if rope.get("rope_type", "default") == "default":
            dim = config.head_dim
            inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.scaling = 1.0
        else:
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos() * self.scaling, angles.sin() * self.scaling


def rotary_dims(config: EGMLAConfig, layer_idx: int) -> list[list[int]]:
    """Per rope key head, which of the F rotary dims its dr dims use (half-split layout, as egmla)."""
    indices = config.rope_frequency_indices
    pairs = config.qk_rope_head_dim // 2
    heads = indices[layer_idx] if indices is not None else [list(range(pairs))] * config.rope_key_heads
    half = config.head_dim // 2
    return [head + [index + half for index in head] for head in heads]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, Hr, G, dr] turned by cos, sin [T, Hr, 1, dr] (rotate-half layout)."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


class EGMLAAttention(nn.Module):
    """egmla's attention with the latent handed to vLLM's MLA layer.

    Gate off or on the latent: expanded prompts and absorbed decodes, on the CPU by `AbsorbedAttention`, on a GPU by
    vLLM's `MLAAttention`; the checkpoint's projections are used as they are. With `rope_key_heads`
    Hr > 1 the cached rope key is all Hr rope keys side by side (Hr * dr values), and each query head's rope query
    sits in its group's slot of an Hr * dr query (zeros elsewhere): the score is exact. Per-layer latent widths are
    zero-padded to the widest (W^{UKV} padded with zero columns): exact too. Where vLLM's CPU latent kernels serve
    (bf16, fp16), the rope keys and rope queries end in `tail_padding` zero columns: the row's width is theirs.
    Gate on K/V, or the RoPE-exact latent: `RebuildingAttention`, whose cache row also holds the token id (gate on
    K/V) and which rebuilds every cached key at every step (`rebuild`: gated, normed, and in "exact" mode the rope
    dims turned by each cached position, which is its slot in the request), and every value only with the gate on
    K/V (without it the weights sum the latents and W^{UV} follows once). `qk_norm`: the query is the source's
    (`q_proj`, its per-head norm, `q_head_proj` to `[nope ; rope]`), and each token's key-norm scales (1/rms of
    `k_norm_proj`, one per key-norm head) are cached after its rope keys; every score of a key is multiplied by its
    scale, by `KeyScaledAttention` (gate off or on the latent) or in `rebuild`. A windowed layer (`sliding_window`)
    attends only within its window (on the CPU the plugin's decode kernel and vLLM's CPU attention for prompts keep
    it, elsewhere a mask in PyTorch; a model with one runs the plugin's attention in every mode); its rotary
    (`rotary`, and the model's per-step cos, sin) is the windowed layers' own where they have one.
    """

    def __init__(self, config: EGMLAConfig, layer_idx: int, cache_config: CacheConfig | None, prefix: str,
                 gate_table: nn.Embedding | None = None, rotary: "EGMLARotary | None" = None):  # fmt: skip
        super().__init__()
        self.num_heads = config.num_attention_heads
        # The heads W^{UKV} rebuilds keys (and values) for; vLLM's absorbed MLA takes it per query head (the loader
        # repeats a key head's rows for its group).
        self.num_key_value_heads = config.num_key_value_heads if not config.absorbs else config.num_attention_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = (
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
        )
        self.rope_key_heads = config.rope_key_heads
        self.key_norm_heads, self.rms_norm_eps = config.key_scale_width, config.rms_norm_eps
        self.pytorch_attention = config.pytorch_attention
        self.kv_lora_rank = config.layer_kv_lora_rank(layer_idx)
        self.latent_width = config.latent_width
        self.q_lora_rank = config.q_lora_rank
        self.caches_token_ids, self.id_digits = config.caches_token_ids, config.id_digits
        self.absorbs, self.rope_mode = config.absorbs, config.rope_mode
        self.rebuilt_key_dim, self.rope_key_width, self.tail_width = (
            config.rebuilt_key_dim,
            config.rope_key_width,
            config.cache_tail_width,
        )
        # The model's own modules, shared (their parameters keep the model's names: registered there first).
        self.gate_table, self.rotary = gate_table, rotary
        dtype = get_current_vllm_config().model_config.dtype
        # On the CPU, `AbsorbedAttention` (prompts expanded per head, decodes absorbed into the query); on a GPU,
        # vLLM's MLA layer. Either takes the checkpoint's projections as they are.
        self.absorbed = self.absorbs and current_platform.is_cpu()
        self.latent_proj_width = self.kv_lora_rank + self.rope_key_width
        self.add_input_projections(config, prefix)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps) if config.kv_latent_norm else None
        kv_width = self.rebuilt_key_dim + self.v_head_dim
        # Built at the padded width: the loader pads the checkpoint's [H*(dn+dv), r] with zero columns.
        self.kv_b_proj = ReplicatedLinear(
            self.latent_width, self.num_key_value_heads * kv_width, bias=False, prefix=f"{prefix}.kv_b_proj"
        )
        self.o_proj = ReplicatedLinear(
            self.num_heads * self.v_head_dim, config.hidden_size, bias=config.attention_bias, prefix=f"{prefix}.o_proj"
        )
        self.gate_embedding_proj = self.gate_norm = None
        if config.gate_enabled:  # W^{UE} onto the latent, or onto every head's keys and values
            gated_width = self.num_key_value_heads * kv_width if self.caches_token_ids else self.kv_lora_rank
            self.gate_embedding_proj = ReplicatedLinear(
                config.gate_embedding_dim, gated_width, bias=False, prefix=f"{prefix}.gate_embedding_proj"
            )
            if config.gate_norm == "rms":
                self.gate_norm = RMSNorm(
                    kv_width if self.caches_token_ids else self.kv_lora_rank, eps=config.rms_norm_eps
                )
        self.register_buffer("rope_dims", torch.tensor(rotary_dims(config, layer_idx)), persistent=False)
        self.tail_padding = tail_padding(self.latent_width, self.tail_width, dtype, self.pytorch_attention)
        self.sliding_window = config.layer_window(layer_idx)
        self.attn = self.attention_layer(config, cache_config, prefix, dtype)

    def add_input_projections(self, config: EGMLAConfig, prefix: str) -> None:
        """The query's (or its low-rank down) projection, the latent's and with `qk_norm` the key norm's, as one
        product of the hidden states; the low-rank query's up projection, or `qk_norm`'s per-head query norm and
        map to `[nope ; rope]`."""
        query_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.key_norm_heads:  # the source's query and key projections (egmla's q_proj and k_norm_proj)
            norm_dim = config.qk_norm_head_dim
            widths = [self.num_heads * norm_dim, self.latent_proj_width, self.key_norm_heads * norm_dim]
            self.q_norm = RMSNorm(norm_dim, eps=config.rms_norm_eps)
            self.q_head_proj = HeadProjection(self.num_heads, query_dim, norm_dim)
        else:
            widths = [self.num_heads * query_dim if self.q_lora_rank is None else self.q_lora_rank]
            widths.append(self.latent_proj_width)
        self.fused_qkv_a_proj = MergedColumnParallelLinear(
            config.hidden_size, widths, bias=config.attention_bias, prefix=f"{prefix}.fused_qkv_a_proj"
        )
        if self.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)
            self.q_b_proj = ReplicatedLinear(
                self.q_lora_rank, self.num_heads * query_dim, bias=False, prefix=f"{prefix}.q_b_proj"
            )

    def attention_layer(
        self, config: EGMLAConfig, cache_config: CacheConfig | None, prefix: str, dtype: torch.dtype
    ) -> MLAAttention:
        layer = dict(
            num_heads=self.num_heads, scale=attention_scaling(config), qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.tail_width + self.tail_padding, v_head_dim=self.v_head_dim,
            q_lora_rank=self.q_lora_rank, kv_lora_rank=self.latent_width, kv_b_proj=self.kv_b_proj,
            cache_config=cache_config, prefix=f"{prefix}.attn",
            attn_backend=latent_backend(self.latent_width, self.tail_width, dtype, self.pytorch_attention),
        )  # fmt: skip
        if not self.absorbs:
            up_values = None if self.caches_token_ids else self.up_values
            return RebuildingAttention(self.rebuild, up_values, self.sliding_window, **layer)
        if self.pytorch_attention:  # on a GPU too: vLLM's MLA kernels neither scale a key's scores nor window them
            return KeyScaledAttention(self.rope_key_width, self.key_norm_heads, self.sliding_window, **layer)
        if self.absorbed:
            return AbsorbedAttention(self.rope_key_width, latent_kernels(dtype), **layer)
        return MLAAttention(**layer)

    def latent(self, kv_latent: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The latent [T, r] as egmla caches it (normed; gated and normed again for the gate on the latent),
        padded to the cache's width."""
        if self.kv_a_layernorm is not None:
            kv_latent = self.kv_a_layernorm(kv_latent)
        if self.gate_embedding_proj is not None and not self.caches_token_ids:
            kv_latent = kv_latent * (1 + self.gate_embedding_proj(self.gate_table(input_ids))[0])
            if self.gate_norm is not None:
                kv_latent = self.gate_norm(kv_latent)
        if self.latent_width == self.kv_lora_rank:
            return kv_latent
        return nn.functional.pad(kv_latent, (0, self.latent_width - self.kv_lora_rank))

    def rebuild(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached rows [R, T, r + tail] of whole requests -> keys [R, T, Hkv, dn + dr] and what the weights sum, as
        egmla's `expand_kv`: the keys gated by 1 + W^{UE} E[id] and normed per head (gate on K/V), their rope dims
        rotated by each cached position ("exact"), or the cached rope keys beside the rebuilt dims (decoupled), and
        with `qk_norm` each key times its key-norm head's cached scale. With no gate on the values the weights sum
        the latents themselves [R, T, 1, r] (`up_values` applies W^{UV} once after), else the rebuilt values
        [R, T, Hkv, dv]."""
        latent, tail = rows.split([self.latent_width, self.tail_width], dim=-1)
        key, value = self.rebuild_keys_and_values(latent, tail)
        if self.key_norm_heads:  # key head h takes key-norm head h // (Hkv / Hn)
            scales = tail[..., self.rope_key_width : self.rope_key_width + self.key_norm_heads]
            key = key * scales.repeat_interleave(self.num_key_value_heads // self.key_norm_heads, dim=-1)[..., None]
        return key, value

    def rebuild_keys_and_values(self, latent: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rebuild` before the key-norm scales: latent [R, T, r], tail [R, T, tail]."""
        requests, length, _ = latent.shape
        if self.caches_token_ids:  # the gate on K/V: keys and values rebuilt together
            kv = self.kv_b_proj(latent.reshape(requests * length, -1))[0]
            id_start = self.rope_key_width + self.key_norm_heads
            digits = tail[..., id_start : id_start + self.id_digits].round().long()
            ids = (digits * 256 ** torch.arange(self.id_digits, device=latent.device)).sum(-1)  # padding rows: 0
            kv = kv * (1 + self.gate_embedding_proj(self.gate_table(ids.flatten()))[0])
            if self.gate_norm is not None:
                kv = self.gate_norm(kv.view(requests * length * self.num_key_value_heads, -1))
            key, value = kv.view(requests, length, self.num_key_value_heads, -1).split(
                [self.rebuilt_key_dim, self.v_head_dim], dim=-1
            )
        else:  # only the keys: W^{UK} rows of W^{UKV}
            key = torch.einsum("rtl,hkl->rthk", latent, self.up_weights()[0].to(latent.dtype))
            value = latent[:, :, None]
        if self.rope_mode == "exact":  # a request's cached positions are 0 .. T-1, in its slots' order
            cos, sin = (
                part[:, self.rope_dims[0]][None, :, None]
                for part in self.rotary(torch.arange(length, device=latent.device))
            )
            key_rope = rotate(key[..., self.qk_nope_head_dim :], cos.to(key.dtype), sin.to(key.dtype))
            return torch.cat([key[..., : self.qk_nope_head_dim], key_rope], dim=-1), value
        rope_key = tail[..., : self.rope_key_width].reshape(
            requests, length, self.rope_key_heads, 1, self.qk_rope_head_dim
        )
        group = self.num_key_value_heads // self.rope_key_heads
        rope_key = rope_key.expand(-1, -1, -1, group, -1).reshape(
            requests, length, self.num_key_value_heads, self.qk_rope_head_dim
        )
        return torch.cat([key, rope_key.to(key.dtype)], dim=-1), value

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W^{UK} [Hkv, dk, r] and W^{UV} [Hkv, dv, r], views of W^{UKV} (at the cache's padded latent width)."""
        return up_weights(self.kv_b_proj.weight, self.num_key_value_heads, self.rebuilt_key_dim, self.v_head_dim)

    def up_values(self, attended: torch.Tensor) -> torch.Tensor:
        """The weighted sums of latents [N, H, r] -> of values [N, H, dv], by each query head's key head's W^{UV}
        (exact: W^{UV} is linear)."""
        tokens = attended.shape[0]
        attended = attended.view(tokens, self.num_key_value_heads, self.num_heads // self.num_key_value_heads, -1)
        values = torch.einsum("ngjr,gvr->ngjv", attended, self.up_weights()[1].to(attended.dtype))
        return values.reshape(tokens, self.num_heads, -1)

    def cache_tail(
        self, rope_key: torch.Tensor, key_scale: torch.Tensor | None, input_ids: torch.Tensor
    ) -> torch.Tensor:
        """What the cache row holds past the latent for the new tokens [T, 1, tail (+ padding)]: the rope keys, the
        key-norm scales (`qk_norm`), the token id as base-256 digits (gate on K/V), or one zero (a RoPE-exact
        latent with neither), then the zero columns vLLM's CPU latent kernels need."""
        parts = [rope_key]
        if key_scale is not None:
            parts.append(key_scale[:, None].to(rope_key.dtype))
        if self.caches_token_ids:
            digits = (input_ids[:, None] // 256 ** torch.arange(self.id_digits, device=input_ids.device)) % 256
            parts.append(digits[:, None].to(rope_key.dtype))
        tail = torch.cat(parts, dim=-1)
        return nn.functional.pad(tail, (0, self.tail_width + self.tail_padding - tail.shape[-1]))

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """hidden_states [T, D] -> the query [T, H, dn + dr] before rope, the latent projection [T, r + Hr * dr],
        and with `qk_norm` each token's key-norm scales [T, Hn] (float32), as egmla's `project_query` and
        `key_scale`."""
        tokens = hidden_states.shape[0]
        parts = self.fused_qkv_a_proj(hidden_states)[0].split(self.fused_qkv_a_proj.output_sizes, dim=-1)
        query, latent = parts[0], parts[1]
        if self.key_norm_heads:
            query = self.q_head_proj(self.q_norm(query.reshape(tokens, self.num_heads, -1)))
            key_scale = key_norm_scale(parts[2].reshape(tokens, self.key_norm_heads, -1), self.rms_norm_eps)
            return query, latent, key_scale
        if self.q_lora_rank is not None:
            query = self.q_b_proj(self.q_a_layernorm(query.contiguous()))[0]
        return query.view(tokens, self.num_heads, -1), latent, None

    def forward(
        self, rotary: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        """rotary: this layer's cos, sin [T, Hr, 1, dr] (`EGMLAModel.layer_rotary`)."""
        tokens = hidden_states.shape[0]
        heads, rope_heads, rope_dim, nope = (
            self.num_heads,
            self.rope_key_heads,
            self.qk_rope_head_dim,
            self.qk_nope_head_dim,
        )
        query, latent, key_scale = self.project(hidden_states)
        kv_latent, rope_key = latent.split([self.kv_lora_rank, self.rope_key_width], dim=-1)
        cos, sin = rotary
        query_rope = rotate(query[..., nope:].reshape(tokens, rope_heads, -1, rope_dim), cos, sin)
        if self.rope_mode != "exact":
            rope_key = rotate(rope_key.view(tokens, rope_heads, 1, rope_dim), cos, sin)
        tail = self.cache_tail(rope_key.reshape(tokens, 1, -1), key_scale, input_ids)
        if self.absorbs and rope_heads > 1:  # each head's rope query in its group's slot of the Hr * dr rope key
            slots = torch.eye(rope_heads, dtype=query.dtype, device=query.device)[None, :, None, :, None]
            query_rope = (query_rope.unsqueeze(3) * slots).reshape(tokens, heads, rope_heads * rope_dim)
        else:
            query_rope = query_rope.reshape(tokens, heads, rope_dim)
        if self.absorbs:  # the absorbed query meets the whole row: zeros past its rope keys
            query_rope = nn.functional.pad(query_rope, (0, tail.shape[-1] - query_rope.shape[-1]))
        query = torch.cat([query[..., :nope], query_rope], dim=-1)
        output = self.attn(
            query, self.latent(kv_latent, input_ids), tail, output_shape=(tokens, heads * self.v_head_dim)
        )
        return self.o_proj(output)[0]


class HeadProjection(nn.Module):
    """One linear map per head, weight [H, out, in] (`qk_norm`'s `q_head_proj`: each normed query head to its
    `[nope ; rope]` query)."""

    def __init__(self, heads: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, out_features, in_features))

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """[T, H, in] -> [T, H, out]."""
        return torch.einsum("thi,hoi->tho", states, self.weight)


def key_norm_scale(keys: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / rms of each key-norm head [T, Hn, d] -> [T, Hn], in float32 (as egmla's `key_norm_scale`)."""
    return torch.rsqrt(keys.float().pow(2).mean(-1) + eps)


def per_query_head(weight: torch.Tensor, config: EGMLAConfig) -> torch.Tensor:
    """W^{UKV} [Hkv * C, r] -> [H * C, r]: each key head's rows repeated for its group of query heads."""
    heads = weight.view(config.num_key_value_heads, -1, weight.shape[-1])
    return heads.repeat_interleave(config.num_attention_heads // config.num_key_value_heads, dim=0).flatten(0, 1)


class EGMLAMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up as one product (vLLM's Llama and Gemma MLPs, by activation)."""

    def __init__(self, config: EGMLAConfig, quant_config: QuantizationConfig | None, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=False, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )  # fmt: skip
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=False, quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )  # fmt: skip
        # transformers' silu and gelu_pytorch_tanh (`check_servable` refuses the others by name).
        self.act_fn = SiluAndMul() if config.hidden_act == "silu" else GeluAndMul(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)[0]))[0]


class EGMLADecoderLayer(nn.Module):
    def __init__(self, config: EGMLAConfig, layer_idx: int, cache_config: CacheConfig | None, prefix: str,
                 gate_table: nn.Embedding | None = None, rotary: "EGMLARotary | None" = None,
                 quant_config: QuantizationConfig | None = None):  # fmt: skip
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = EGMLAAttention(config, layer_idx, cache_config, f"{prefix}.self_attn", gate_table, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = EGMLAMLP(config, quant_config, prefix=f"{prefix}.mlp")
        self.attention_output_norm = self.mlp_output_norm = None  # `sandwich_norms`: on each output (Gemma 3)
        if config.sandwich_norms:
            self.attention_output_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp_output_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, rotary, hidden_states: torch.Tensor, residual: torch.Tensor | None, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output and the residual stream before it, as vLLM's Llama (norms fused with the adds). With
        `sandwich_norms` each output is normed before it joins the stream, as vLLM's Gemma 3: the next fused
        add+norm adds the normed output."""
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(rotary, hidden_states, input_ids)
        if self.attention_output_norm is not None:
            hidden_states = self.attention_output_norm(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        if self.mlp_output_norm is not None:
            hidden_states = self.mlp_output_norm(hidden_states)
        return hidden_states, residual


@support_torch_compile  # compiled unless `enforce_eager`, as vLLM's Llama; the attention stays one opaque op
class EGMLAModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config: EGMLAConfig = vllm_config.model_config.hf_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.gate_embeddings = nn.ModuleList(
            nn.Embedding(config.vocab_size, config.gate_embedding_dim)
            for _ in range(config.num_hidden_layers // config.gate_layers_per_table if config.gate_enabled else 0)
        )
        # Made in the model's dtype (vLLM builds it under that default), as Gemma's scaled embedding multiplies.
        self.register_buffer("embedding_multiplier", torch.tensor(config.embedding_multiplier), persistent=False)
        # The rotaries, the windowed layers' own base second (`sliding_rope_theta`), and which one each layer takes.
        self.rotaries = nn.ModuleList([EGMLARotary(config)])
        if config.sliding_rope_theta is not None:
            self.rotaries.append(EGMLARotary(config, rope_theta=config.sliding_rope_theta))
        sliding = len(self.rotaries) - 1  # the first where the windowed layers share the others' rotary
        kinds = [sliding if config.layer_window(i) is not None else 0 for i in range(config.num_hidden_layers)]
        self.register_buffer("layer_rotary_kind", torch.tensor(kinds)[:, None, None], persistent=False)  # [L, 1, 1]
        self.layers = nn.ModuleList(
            EGMLADecoderLayer(
                config, i, vllm_config.cache_config, f"{prefix}.layers.{i}",
                self.gate_embeddings[i // config.gate_layers_per_table] if config.gate_enabled else None,
                self.rotaries[kinds[i]], vllm_config.quant_config,
            )
            for i in range(config.num_hidden_layers)
        )  # fmt: skip
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        layer_dims = [rotary_dims(config, i) for i in range(config.num_hidden_layers)]
        self.register_buffer("layer_rope_dims", torch.tensor(layer_dims), persistent=False)  # [L, Hr, dr]

    def layer_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's cos, sin [T, L, Hr, 1, dr] of its rope keys' own frequencies in its own rotary, gathered
        once per step."""
        rotations = [rotary(positions) for rotary in self.rotaries]  # each (cos, sin) [T, F]
        return tuple(
            torch.stack(parts, dim=1).to(dtype)[:, self.layer_rotary_kind, self.layer_rope_dims].unsqueeze(3)
            for parts in zip(*rotations, strict=True)
        )  # [T, K, F] -> [T, L, Hr, 1, dr]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings, times `embedding_multiplier` in their dtype (as egmla)."""
        embeds = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier == 1.0:
            return embeds
        return embeds * self.embedding_multiplier.to(embeds.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_input_ids(input_ids), None
        cos, sin = self.layer_rotary(positions, hidden_states.dtype)  # the model's dtype
        for index, layer in enumerate(self.layers):
            hidden_states, residual = layer((cos[:, index], sin[:, index]), hidden_states, residual, input_ids)
        return self.norm(hidden_states, residual)[0]


class EGMLAForCausalLM(nn.Module):
    """vLLM's entry point for an egmla folder (`architectures: ["EGMLAForCausalLM"]`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config: EGMLAConfig = vllm_config.model_config.hf_config
        if get_tensor_model_parallel_world_size() != 1:
            raise ValueError("egmla-vllm serves on one device (tensor_parallel_size=1) for now.")
        self.config = config
        self.model = EGMLAModel(vllm_config=vllm_config, prefix="model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if input_ids is None:
            raise ValueError("egmla-vllm needs token ids (the gate is looked up by id), not inputs_embeds.")
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def up_weight(self, weight: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """A checkpoint's W^{UKV} at the cache's padded latent width, one key head per query head where vLLM's
        absorbed MLA takes it so."""
        if weight.shape[1] < param.shape[1]:
            weight = nn.functional.pad(weight, (0, param.shape[1] - weight.shape[1]))  # padded latent
        if weight.shape[0] < param.shape[0]:
            weight = per_query_head(weight, self.config)
        return weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The egmla checkpoint's names as they are, but the projections vLLM merges (`MERGED_SHARDS`), loaded as
        shards of the merged one."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, weight in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for source, (merged, shard_id) in MERGED_SHARDS.items():
                if source in name:
                    name = name.replace(source, merged)
                    params[name].weight_loader(params[name], weight, shard_id)
                    break
            else:
                if name.endswith("kv_b_proj.weight"):
                    weight = self.up_weight(weight, params[name])
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, weight)
            loaded.add(name)
        return loaded


# The checkpoint's projections that share one product here: the merged projection's name and the shard each fills.
MERGED_SHARDS = {
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0), ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
    ".self_attn.q_proj.": (".self_attn.fused_qkv_a_proj.", 0),
    ".self_attn.q_a_proj.": (".self_attn.fused_qkv_a_proj.", 0),
    ".self_attn.kv_a_proj_with_mqa.": (".self_attn.fused_qkv_a_proj.", 1),
    ".self_attn.k_norm_proj.": (".self_attn.fused_qkv_a_proj.", 2),
}  # fmt: skip
