"""What a converted model costs at decode against its source: per cached token per layer, the values attention reads
and the multiply-adds it spends on them at every step (arithmetic), and a measured ms/step ratio at one cell.

- The source (Llama, GQA) reads 2 * Hkv * hd values and does 2 * Hq * hd multiply-adds (q.k and p.v per head).
- The absorbed MQA (decoupled rope key, gate off or on the latent) reads the latent and the rope key once for every
  head and does Hq * (r + dr + r): a score over [latent ; rope key], a weighted sum of latents.
- The rebuilding forms (the RoPE-exact latent, the gate on K/V) rebuild every cached key once per key head
  (`num_key_value_heads`): r * Hkv * dk multiply-adds, and with the gate on K/V the values and the gate too,
  (r + de) * Hkv * (dk + dv); then the attention itself.
"""

from dataclasses import asdict, dataclass

import torch

from ..configuration_egmla import EGMLAConfig
from ..measure import cache_bytes_per_token, decode_state, median_ms
from .source import attention_shape

MEASURED_BATCH = 8  # the cell of the measured ratio: batch 8 at the source's context, at most 2048
MEASURED_CONTEXT = 2048


@dataclass(frozen=True)
class DecodeCost:
    path: str  # "source", "absorbed" or "rebuilt"
    values_per_token_per_layer: float
    multiply_adds_per_token_per_layer: float


def source_cost(config) -> DecodeCost:
    """A Llama's attention per cached token per layer."""
    shape = attention_shape(config)
    return DecodeCost("source", shape.key_value_values, 2 * shape.query_heads * shape.head_dim)


def egmla_cost(config: EGMLAConfig) -> DecodeCost:
    """An EG-MLA model's attention per cached token per layer (latent widths averaged over layers)."""
    heads = config.num_attention_heads
    values = config.kv_cache_values_per_token() / config.num_hidden_layers
    rank = values - config.rope_key_width - config.key_scale_width
    rope_dims = 0 if config.rope_mode == "exact" else config.qk_rope_head_dim
    scales = heads if config.qk_norm else 0  # each score multiplied by its key's norm scale
    if config.absorbs:
        return DecodeCost("absorbed", values, heads * (rank + rope_dims + rank) + scales)
    rebuilt_key = config.qk_nope_head_dim + (config.qk_rope_head_dim if config.rope_mode == "exact" else 0)
    key_heads = config.num_key_value_heads  # keys are rebuilt once per key head
    if config.gate_enabled and config.gate_position == "kv":  # the values too, and the gate of every cached token
        rebuilt = key_heads * (rebuilt_key + config.v_head_dim)
        rebuild = (rank + config.gate_embedding_dim) * rebuilt
        attention = heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    else:  # only keys: the weights sum the latents, W^{UV} is applied once per query, not per cached token
        rebuild = rank * key_heads * rebuilt_key
        attention = heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + rank)
    return DecodeCost("rebuilt", values, rebuild + attention + scales)


def cost_row(cost: DecodeCost, source: DecodeCost) -> dict:
    """The cost and its ratios to the source's, as the report stores them."""
    return {
        **asdict(cost),
        "values_vs_source": cost.values_per_token_per_layer / source.values_per_token_per_layer,
        "multiply_adds_vs_source": cost.multiply_adds_per_token_per_layer / source.multiply_adds_per_token_per_layer,
    }


def rebuild_warning(config: EGMLAConfig, source_config) -> str | None:
    """One line for a user who asked for a rebuilding form: what it costs at decode against the source."""
    cost, source = egmla_cost(config), source_cost(source_config)
    if cost.path != "rebuilt":
        return None
    why = "rope_mode='exact'" if config.rope_mode == "exact" else "the gate on K/V (gate_position='kv')"
    return (
        f"note: {why} rebuilds every cached key{' and value' if config.caches_token_ids else ''} at every "
        f"decode step, for each of its {config.num_key_value_heads} key heads: "
        f"{cost.multiply_adds_per_token_per_layer:,.0f} multiply-adds per cached token per layer against the "
        f"source's {source.multiply_adds_per_token_per_layer:,.0f}, so it decodes slower than its source; the "
        "absorbed default (decoupled rope key, gate on the latent or off) does not."
    )


@torch.no_grad()
def measure_decode(source: torch.nn.Module, student: torch.nn.Module, repetitions: int = 3) -> dict:
    """ms per decode step of the source and the converted model on their default paths, interleaved in this process,
    at batch 8 and the source's context (at most 2048), over caches filled with random contents (a step costs the
    same whatever the cache holds); and the cache bytes per token (all layers) of real `generate` calls."""
    context = min(MEASURED_CONTEXT, source.config.max_position_embeddings - 8)
    states = {
        "source": decode_state(source, "dynamic", MEASURED_BATCH, context),
        "converted": decode_state(student, "dynamic", MEASURED_BATCH, context),
    }
    ms = median_ms(states, repetitions, steps=2)
    probe = torch.randint(0, source.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    return {
        "batch": MEASURED_BATCH,
        "context": context,
        "ms_per_step": ms,
        "ratio": ms["converted"] / ms["source"],
        "cache_bytes_per_token": {
            "source": cache_bytes_per_token(source, probe, new_tokens=4),
            "converted": cache_bytes_per_token(student, probe, new_tokens=4),
        },
    }
