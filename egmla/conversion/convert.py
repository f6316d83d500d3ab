"""The conversion's mechanics, for a rope split already chosen (the split search, `search.py`, sits above them, and
`plan.py` above both):

1. Resolve the budget: the options against the source (rope key widths, latent width, what the cache holds).
2. Split RoPE per layer: the cached rope key and the NoPE dims the latent rebuilds (`rope.py`), from the
   calibration statistics (`calibration.py`).
3. Factorize per layer: the stacked NoPE keys and values into W^{DKV} and W^{UKV} (`factorization.py`).
4. Allocate ranks across layers (uniform, or by retained energy under the same total). Steps 1-4 make the
   `ConversionPlan`, once.
5. Build the EG-MLA model from the plan: the query rows permuted to [nope ; rope], the up-projection per source KV
   head (the rebuilding forms) or repeated for every query head of a group (the absorbed MQA), everything else
   (MLP, norms, embeddings, RoPE base and scaling, attention scale) copied, and the gate at the identity, so the
   fresh model equals its MLA approximation.
"""

import dataclasses
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import LlamaForCausalLM

from ..configuration_egmla import GATE_POSITIONS, EGMLAConfig
from ..modeling_egmla import EGMLAForCausalLM
from ..options import check_fields, option
from . import families
from .calibration import LayerStatistics
from .factorization import FACTORIZATIONS, RANK_ALLOCATIONS, Factorization, allocate_ranks, factorize, output_weights
from .families import norm_weight
from .rope import PAIR_SELECTIONS, RopeSplit, llama_rope_parameters, split_rope
from .source import attention_shape, key_norm_heads

ROPE_SPLITS = ("auto", "exact", "shared", "per_head")


@dataclass(frozen=True)
class ConversionOptions:
    """Everything a conversion can be told, validated once. The budget is exactly one of `kv_lora_rank` and
    `kv_cut`; every other field has the default the `egmla` commands use (the CLI's flags are made from these
    fields: `--rope-split` sets `rope_split`)."""

    kv_lora_rank: int | None = option(None, "latent width", bounds="[1, inf)")
    kv_cut: float | None = option(
        None, "or: the fraction of the source's K/V values per token to remove", bounds="(0, 1)"
    )
    rope_split: str = option(
        "auto",
        "where RoPE goes. auto: the best width of a shared rope key on held-out calibration blocks at the same budget "
        "(absorbed decode); shared: one rope key of principal components for all heads (TransMLA); per_head: one per "
        "KV head (MHA2MLA); exact: every key rebuilt from the latent and rotated at every step (RoPE kept exactly, "
        "decode slower than the source)",
        choices=ROPE_SPLITS,
    )
    rope_pairs: int | None = option(
        None,
        "rotary pairs in each rope key (default: head_dim // 4 shared, head_dim // 16 per head)",
        bounds="[1, inf)",
    )
    pair_selection: str = option(
        "rotation", "which pairs keep rotating: contribution x rotation variance, or MHA2MLA's 2-norm", PAIR_SELECTIONS
    )
    # 0 by default: at the same budget the gate on the latent left held-out perplexity where it was for many more
    # parameters (docs/results.md#behind-the-defaults). The gate starts as the identity.
    gate_embedding_dim: int = option(0, "width of the gate tables; 0 = plain MLA", bounds="[0, inf)")
    gate_position: str = option(
        "latent",
        "latent: the gate scales the cached latent (absorbed decode); kv: the paper's gate on the rebuilt K/V (every "
        "cached latent re-expanded at every step)",
        GATE_POSITIONS,
    )
    factorization: str = option(
        "activation", "whitened and output-weighted (needs calibration), or a plain SVD of the weights", FACTORIZATIONS
    )
    rank_allocation: str = option(
        "uniform", "every layer kv_lora_rank, or per-layer ranks by retained energy (same total)", RANK_ALLOCATIONS
    )
    damping: float = option(
        1e-2, "added to the covariance before whitening, as a fraction of its mean diagonal", bounds="[0, inf)"
    )
    key_value_balance: float = option(
        0.5, "weight of key errors against value errors (chosen on stories260K)", bounds="(0, inf)"
    )
    seed: int = 0  # of the gate tables' random rows (the CLI's --seed, shared with sampling and training)

    def __post_init__(self) -> None:
        check_fields(self)
        if (self.kv_lora_rank is None) == (self.kv_cut is None):
            raise ValueError("Give exactly one of kv_lora_rank and kv_cut.")
        if self.gate_embedding_dim == 0 and self.gate_position != "latent":
            raise ValueError(
                f"gate_position={self.gate_position!r} (--gate-position) places a gate, and there is none: give "
                "--gate-embedding-dim N (N > 0) too, or leave --gate-position out."
            )
        if self.rope_split == "auto" and self.rope_pairs is not None:
            object.__setattr__(self, "rope_split", "shared")  # a given width leaves nothing to choose
        if self.rope_split == "exact" and self.rope_pairs is not None:
            raise ValueError("rope_pairs sets the decoupled rope key; rope_split='exact' keeps every pair exact.")


@dataclass(frozen=True)
class Budget:
    """The options resolved against one source: what every layer's cache will hold."""

    rope_key_heads: int
    rope_pairs: int
    nope_dim: int  # qk_nope_head_dim of the student
    kv_lora_rank: int  # per layer on average (the total under rank_allocation="energy")
    source_values_per_token_per_layer: int
    values_per_token_per_layer: int


def default_rope_pairs(head_dim: int, rope_split: str) -> int:
    """MHA2MLA's default for per-head keys (head_dim / 16 pairs, at least 1); head_dim / 4 for a shared key (the
    best of the pair counts tried on SmolLM2-135M at MHA2MLA's cut, by calibration perplexity: docs/results.md#behind-the-defaults)."""
    return max(1, head_dim // 16) if rope_split == "per_head" else max(1, head_dim // 4)


def cut_values(source_config, kv_cut: float) -> int:
    """The K/V values per token per layer that a cut of `kv_cut` leaves of the source's."""
    return round(attention_shape(source_config).key_value_values * (1 - kv_cut))


def kv_lora_rank_for_cut(source_config, kv_cut: float, rope_values: int) -> int:
    """The latent width that, with `rope_values` rope-key values, caches (1 - kv_cut) of the source's K/V values
    per token per layer."""
    rank = cut_values(source_config, kv_cut) - rope_values
    if rank <= 0:
        raise ValueError(
            f"A {kv_cut:.2%} cut leaves {cut_values(source_config, kv_cut)} values per token per layer, no more "
            f"than the {rope_values} values of the rope keys (and key-norm scales): lower rope_pairs or kv_cut."
        )
    return rank


def resolve_budget(source_config, options: ConversionOptions) -> Budget:
    """Rope key widths and the latent width for this source, refused with the bound when the source cannot hold
    them."""
    shape = attention_shape(source_config)
    head_dim, key_heads = shape.head_dim, shape.key_heads
    if options.rope_split == "auto":
        raise ValueError("rope_split='auto' is resolved by egmla.conversion.search.choose_split before the budget.")
    exact, per_head = options.rope_split == "exact", options.rope_split == "per_head"
    pairs = options.rope_pairs if options.rope_pairs is not None else default_rope_pairs(head_dim, options.rope_split)
    max_pairs = head_dim // 2 if per_head else key_heads * head_dim // 2
    if exact:  # every pair of every head stays exact, inside the latent; no rope key is cached
        pairs = head_dim // 2
    elif not 1 <= pairs <= max_pairs:
        raise ValueError(
            f"rope_pairs must lie in [1, {max_pairs}] for rope_split={options.rope_split!r} (head_dim {head_dim}, "
            f"{key_heads} KV heads), got {pairs}."
        )
    rope_key_heads = key_heads if per_head and not exact else 1
    # Cached beside the latent: the rope keys, and a QK-norm source's key-norm scales (one per key head).
    rope_values = (0 if exact else rope_key_heads * 2 * pairs) + key_norm_heads(source_config)
    rank = options.kv_lora_rank
    if rank is None:
        rank = kv_lora_rank_for_cut(source_config, options.kv_cut, rope_values)
    nope_dim = 0 if exact else head_dim - 2 * pairs if per_head else head_dim
    stacked_rows = key_heads * ((head_dim if exact else nope_dim) + head_dim)  # per KV head: rebuilt key, value
    max_rank = min(stacked_rows, source_config.hidden_size)
    if not 1 <= rank <= max_rank:
        raise ValueError(
            f"kv_lora_rank {rank} is out of range: the stacked NoPE-key/value projection of this source is "
            f"{stacked_rows} x {source_config.hidden_size}, so the rank must lie in [1, {max_rank}]."
        )
    return Budget(rope_key_heads, pairs, nope_dim, rank, shape.key_value_values, rank + rope_values)


@dataclass(frozen=True)
class LayerPlan:
    """One layer's conversion: the frequency each rope pair turns at, the latent's width, and until the layer's
    weights are built its rope split and truncated factors (down [r, D], up [Hkv * (dk + hd), r])."""

    frequencies: list[list[int]]
    rank: int
    split: RopeSplit | None = None
    factors: tuple[torch.Tensor, torch.Tensor] | None = None

    def built(self) -> "LayerPlan":
        """What the student's config still reads once the layer's weights are built (its tensors let go)."""
        return LayerPlan(self.frequencies, self.rank)


def layer_plan(split: RopeSplit, factorization: Factorization, rank: int) -> LayerPlan:
    return LayerPlan(split.frequencies, rank, split, factorization.truncate(rank))


@dataclass(frozen=True)
class ConversionPlan:
    """What a conversion builds, computed once per source and passed on: the options with the rope split chosen,
    the budget they give on this source, a plan per layer (a conversion that goes layer by layer adds each as it
    goes; none: a shape alone, its rope keys on the first pairs), and the split search's table where one ran."""

    options: ConversionOptions
    budget: Budget
    layers: list[LayerPlan] = field(default_factory=list)
    candidates: list[dict] = field(default_factory=list)


def has_bias(attention: torch.nn.Module) -> bool:
    """Whether the source attention has biases (Qwen2's q/k/v, Llama's attention_bias)."""
    return any(getattr(attention, name).bias is not None for name in ("q_proj", "k_proj", "v_proj", "o_proj"))


def projection_rows(linear: torch.nn.Linear, heads: int, biased: bool) -> torch.Tensor:
    """A projection's rows [heads, hd, D] in float64; `biased`: [heads, hd, D + 1], the bias as the weight of a
    constant input 1, so that every linear step of the conversion carries it like any other column."""
    rows = linear.weight.detach().double().cpu()
    if biased:
        bias = linear.bias.detach().double().cpu() if linear.bias is not None else rows.new_zeros(len(rows))
        rows = torch.cat([rows, bias[:, None]], dim=1)
    return rows.view(heads, -1, rows.shape[1])


def has_qk_norm(attention: torch.nn.Module) -> bool:
    """Whether each query and key head is RMS-normed before RoPE (Qwen3)."""
    return hasattr(attention, "q_norm") and hasattr(attention, "k_norm")


def source_rows(attention: torch.nn.Module, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The source layer's query [Hq, hd, D'], key [Hkv, hd, D'] and value [Hkv, hd, D'] rows, D' = D + 1 with biases.
    The value bias column is left at zero: attention weights sum to 1, so it passes every head's softmax unchanged
    and the student adds it after the output projection (`o_proj`'s bias) instead of spending the latent on it. A
    QK-norm source's query and key rows carry their norm's weight (its scale per token and head is the student's
    `qk_norm`), unless `raw`."""
    shape, biased = attention_shape(attention.config), has_bias(attention)
    query = projection_rows(attention.q_proj, shape.query_heads, biased)
    key = projection_rows(attention.k_proj, shape.key_heads, biased)
    value = projection_rows(attention.v_proj, shape.key_heads, biased)
    if has_qk_norm(attention) and not raw:
        query = query * norm_weight(attention.q_norm).double().cpu()[None, :, None]
        key = key * norm_weight(attention.k_norm).double().cpu()[None, :, None]
    if biased:
        value[..., -1] = 0
    return query, key, value


def input_statistics(attention: torch.nn.Module, statistics: LayerStatistics) -> LayerStatistics:
    """The statistics the rows of `source_rows` are weighed with: with biases, of the input with a constant 1."""
    if not has_bias(attention):
        return statistics
    return dataclasses.replace(statistics, covariance=statistics.with_bias_input())


def stacked_rows(split: RopeSplit, value: torch.Tensor) -> torch.Tensor:
    """The rows the latent must rebuild: [Hkv * (dk + hd), D], per KV head its rebuilt key rows (NoPE, or every dim
    in "exact" mode), then its value rows [Hkv, hd, D]."""
    return torch.cat([torch.cat([split.nope_key[g], value[g]]) for g in range(len(value))])


def factorize_layer(
    attention: torch.nn.Module,
    statistics: LayerStatistics,
    inv_freq: torch.Tensor,
    budget: Budget,
    options: ConversionOptions,
) -> tuple[RopeSplit, Factorization]:
    """One source attention layer: its rope split (the cached rope key and the NoPE dims the latent rebuilds) and
    the factorization of its stacked [NoPE key ; value] rows."""
    query, key, value = source_rows(attention)
    statistics = input_statistics(attention, statistics)
    split = split_rope(query, key, statistics, inv_freq, options.rope_split, budget.rope_pairs, options.pair_selection)
    if has_bias(attention) and options.rope_split != "exact" and not has_qk_norm(attention):
        # A NoPE key bias adds q . b to every key of a query alike, which the softmax ignores; in "exact" mode it
        # is rotated with the key, and under QK-norm each key's scale multiplies it, so there it stays in the latent.
        split.nope_key[..., -1] = 0
    stacked = stacked_rows(split, value)
    if options.factorization == "weight":
        return split, factorize(stacked, None, options.damping)
    covariance = statistics.covariance.double()
    output = attention.o_proj.weight.detach().double().cpu()
    weights = output_weights(split, value, output, covariance, options.key_value_balance)
    return split, factorize(stacked, covariance, options.damping, weights)


def student_key_heads(source_config, options: "ConversionOptions") -> int:
    """The student's `num_key_value_heads`: the rebuilding forms (RoPE-exact keys, the gate on K/V) rebuild keys (and
    values) once per source KV head; the absorbed MQA never rebuilds, and keeps W^{UKV} per query head, free to part
    in the fitting."""
    rebuilds = options.rope_split == "exact" or (options.gate_position == "kv" and options.gate_embedding_dim > 0)
    shape = attention_shape(source_config)
    return shape.key_heads if rebuilds else shape.query_heads


def student_config(source: LlamaForCausalLM, plan: ConversionPlan) -> EGMLAConfig:
    """The EG-MLA config of the converted model: the source's dims, the budget's cache, the gate at the identity."""
    config, options, budget = source.config, plan.options, plan.budget
    shape = attention_shape(config)
    qk_norm = has_qk_norm(source.model.layers[0].self_attn)
    # A plan without layers (a budget alone: a shape, as the benchmarks build) turns its rope keys on the first pairs.
    frequencies = [layer.frequencies for layer in plan.layers] if options.rope_split != "exact" else None
    return EGMLAConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=shape.query_heads,
        num_key_value_heads=student_key_heads(config, options),
        q_lora_rank=None,
        kv_lora_rank=[layer.rank for layer in plan.layers]
        if options.rank_allocation == "energy"
        else budget.kv_lora_rank,
        qk_nope_head_dim=budget.nope_dim,
        qk_rope_head_dim=2 * budget.rope_pairs,
        v_head_dim=shape.head_dim,
        rope_key_heads=budget.rope_key_heads,
        rope_mode="exact" if options.rope_split == "exact" else "decoupled",  # the model's words for the split
        gate_embedding_dim=options.gate_embedding_dim,
        gate_position=options.gate_position,
        gate_norm="none",  # a norm after the gate would change the function: the fresh gate must be the identity
        kv_latent_norm=False,
        qk_norm=qk_norm,
        qk_norm_head_dim=shape.head_dim if qk_norm else None,
        qk_norm_key_heads=shape.key_heads if qk_norm else None,
        hidden_act=families.hidden_act(config),
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters=llama_rope_parameters(source),
        rope_frequency_dim=shape.head_dim,
        rope_frequency_indices=frequencies or None,
        attention_dropout=config.attention_dropout,
        attention_bias=has_bias(source.model.layers[0].self_attn),
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        initializer_range=config.initializer_range,
        **families.student_fields(config),
    )


def attention_state(source: LlamaForCausalLM, plan: ConversionPlan) -> dict[str, torch.Tensor]:
    """The student's attention weights per layer from the plan's splits and truncated (down, up) factors."""
    state, rotary = {}, source.model.rotary_emb
    for layer_idx, (layer, planned) in enumerate(zip(source.model.layers, plan.layers, strict=True)):
        scaling = families.attention_factor(rotary, source.config, layer_idx)
        state.update(layer_attention_state(layer_idx, layer.self_attn, plan, planned, scaling))
    return state


def layer_attention_state(
    layer_idx: int, attention: torch.nn.Module, plan: ConversionPlan, planned: LayerPlan, attention_scaling: float
) -> dict[str, torch.Tensor]:
    """One layer's student attention weights from its plan (rope split, truncated (down, up) factors); `plan` gives
    the student's shape (its layers may not all be planned yet: streaming goes layer by layer)."""
    split, (down, up) = planned.split, planned.factors
    source, options, budget = attention.config, plan.options, plan.budget
    shape = attention_shape(source)
    head_dim, key_heads, query_heads = shape.head_dim, shape.key_heads, shape.query_heads
    group = query_heads // key_heads
    # The student's softmax scale is 1/sqrt(dn + dr), the source's its own (1/sqrt(hd), Gemma 3's
    # 1/sqrt(query_pre_attn_scalar)): the queries make up the difference.
    query_factor = attention.scaling * (budget.nope_dim + 2 * budget.rope_pairs) ** 0.5
    # The source scales whole heads by the rope's attention factor (YaRN); NoPE dims must keep it. In "exact"
    # mode the rows in the NoPE slot are every dim of the head, rotated (and so scaled) as in the source.
    nope_factor = query_factor * (1.0 if options.rope_split == "exact" else attention_scaling**2)
    prefix = f"model.layers.{layer_idx}.self_attn."
    up = up.view(key_heads, split.nope_key.shape[1] + head_dim, -1)  # per KV head: [rebuilt key ; value] rows
    queries = [
        torch.cat([nope_factor * split.nope_query[h], query_factor * split.rope_query[h]]) for h in range(query_heads)
    ]
    if has_qk_norm(attention):
        state = qk_norm_state(prefix, attention, queries)
    else:
        state = linear_state(prefix + "q_proj.", torch.cat(queries), source.hidden_size)
    state.update(linear_state(prefix + "kv_a_proj_with_mqa.", torch.cat([down, split.rope_key]), source.hidden_size))
    per_key_head = student_key_heads(source, options) == key_heads
    heads = up.unbind() if per_key_head else [up[h // group] for h in range(query_heads)]
    state[prefix + "kv_b_proj.weight"] = torch.cat(heads).float()
    state.update(output_state(prefix + "o_proj.", attention, group))
    return state


def qk_norm_state(prefix: str, attention: torch.nn.Module, queries: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A QK-norm source's student query: the source's own projection and norm, then per head the map from the normed
    head to its `[nope ; rope]` rows (`queries`, made from the rows that carry the norm's weight: each is that map
    times them, so the pseudo-inverse finds it exactly); and the source's key projection, whose norms are cached."""
    raw_query, raw_key, _ = source_rows(attention, raw=True)
    folded_query, _, _ = source_rows(attention)
    hidden_size = attention.config.hidden_size
    state = linear_state(prefix + "q_proj.", raw_query.flatten(0, 1), hidden_size)
    state |= linear_state(prefix + "k_norm_proj.", raw_key.flatten(0, 1), hidden_size)
    state[prefix + "q_norm.weight"] = norm_weight(attention.q_norm).float().cpu()
    maps = [rows @ torch.linalg.pinv(folded) for rows, folded in zip(queries, folded_query, strict=True)]
    state[prefix + "q_head_proj.weight"] = torch.stack(maps).float()
    return state


def linear_state(prefix: str, rows: torch.Tensor, hidden_size: int) -> dict[str, torch.Tensor]:
    """A student projection's weight [out, D] and, where the rows carry a bias column ([out, D + 1]), its bias."""
    state = {prefix + "weight": rows[:, :hidden_size].float()}
    if rows.shape[1] > hidden_size:
        state[prefix + "bias"] = rows[:, hidden_size].float()
    return state


def output_state(prefix: str, attention: torch.nn.Module, group: int) -> dict[str, torch.Tensor]:
    """The output projection; with biases, its bias takes the value bias of every head through it (the softmax
    weights sum to 1, so each head's output carries its KV head's value bias whole)."""
    output = attention.o_proj
    state = {prefix + "weight": output.weight}
    if has_bias(attention):
        value_bias = attention.v_proj.bias
        value_bias = torch.zeros(attention.v_proj.out_features) if value_bias is None else value_bias.detach().cpu()
        head_dim = attention_shape(attention.config).head_dim
        per_query_head = value_bias.view(-1, head_dim).repeat_interleave(group, dim=0).flatten()
        bias = output.weight.detach().double().cpu() @ per_query_head.double()
        if output.bias is not None:
            bias = bias + output.bias.detach().double().cpu()
        state[prefix + "bias"] = bias.float()
    return state


def assemble(source: LlamaForCausalLM, config: EGMLAConfig, attention: dict, seed: int) -> EGMLAForCausalLM:
    """The student with the converted attention and everything else of the source; only the gate starts fresh
    (tables random, drawn from `seed` without touching the caller's random state; up-projection zero)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        student = EGMLAForCausalLM(config)
    state = dict(attention)
    for layer_idx, layer in enumerate(source.model.layers):
        state.update(families.layer_state(source.config, layer_idx, layer))
    state["model.embed_tokens.weight"] = source.model.embed_tokens.weight
    state["model.norm.weight"] = norm_weight(source.model.norm)
    state["lm_head.weight"] = source.lm_head.weight
    missing, unexpected = student.load_state_dict(state, strict=False)
    assert all("gate_" in name for name in missing) and not unexpected, (missing, unexpected)
    if config.tie_word_embeddings:
        student.tie_weights()
    return student.to(device=source.device, dtype=source.dtype).eval()  # where the source is, in its dtype


def plan_layers(
    source: LlamaForCausalLM, options: ConversionOptions, statistics: list[LayerStatistics]
) -> ConversionPlan:
    """The plan for options whose rope split is chosen: the budget once, per layer one rope split and one
    factorization, the ranks allocated across layers."""
    if options.rope_split == "auto":
        raise ValueError("rope_split='auto' is resolved by egmla.conversion.plan.plan_conversion before the layers.")
    budget = resolve_budget(source.config, options)
    splits, factorizations = [], []
    for layer_idx, (layer, stats) in enumerate(zip(
        tqdm(source.model.layers, desc="factorizing", unit="layer", leave=False), statistics, strict=True
    )):  # fmt: skip
        inv_freq = families.inv_freq(source.model.rotary_emb, source.config, layer_idx)
        split, factorization = factorize_layer(layer.self_attn, stats, inv_freq, budget, options)
        splits.append(split)
        factorizations.append(factorization)
    ranks = allocate_ranks([f.energy() for f in factorizations], budget.kv_lora_rank, options.rank_allocation)
    planned = zip(splits, factorizations, ranks, strict=True)
    layers = [layer_plan(split, factorization, rank) for split, factorization, rank in planned]
    return ConversionPlan(options, budget, layers)


def build_student(source: LlamaForCausalLM, plan: ConversionPlan) -> EGMLAForCausalLM:
    """The EG-MLA model a plan describes (see the module docstring, step 5); the source is never modified."""
    config = student_config(source, plan)
    return assemble(source, config, attention_state(source, plan), plan.options.seed)
