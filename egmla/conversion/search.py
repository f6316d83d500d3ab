"""The default split (`rope_split="auto"`): with only a budget given, convert a few absorbable ways at that budget (a
decoupled rope key of a few widths, the latent taking the rest), score each on a held-out slice of the calibration
blocks, and keep the best. One pass over the source's layers (`LayerSource`: a model in memory, or a checkpoint read
a layer at a time) does it: as each layer goes by it is calibrated on the rest of the blocks, every candidate
converts it in closed form (gate-free, every layer at the same rank), and each candidate's own residual stream over
the held-out blocks advances through its converted layer beside the source's; at the end the final norm and the
head score every stream. The statistics go to the caller layer by layer (`keep`), so the conversion that follows
reads them instead of calibrating again. Every candidate's perplexity goes into the report beside its decode cost
against the source (values read and multiply-adds per cached token per layer), so a user can trade quality for
decode speed knowingly. The rebuilding RoPE-exact latent is converted only when asked for by name (`rope_split="exact"`): it keeps
RoPE exact but rebuilds every cached key at every step, several times the source's arithmetic."""

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..text import packed_blocks
from .calibration import LayerStatistics
from .convert import (
    ConversionOptions,
    ConversionPlan,
    cut_values,
    resolve_budget,
    student_key_heads,
)
from .decode_cost import cost_row, egmla_cost, source_cost
from .layer_source import LayerSource, convert_layer, layer_config, run_layer, student_layer, student_layer_output
from .scoring import stream_perplexity
from .source import attention_shape

HELD_OUT_BLOCKS = 8  # at most: a slice of the calibration blocks that the candidates are not fitted on
LONGEST_SCORED_BLOCK = 512
# The shares of a cut's values the shared rope key may take (the latent takes the rest). A quarter was best on
# stories260K (4 pairs, 8 of 32 values) and SmolLM2-135M (16 pairs, 32 of 120 values) alike.
ROPE_SHARES = (1 / 8, 1 / 4, 3 / 8)


def rope_pair_choices(source_config, options: ConversionOptions) -> list[int]:
    """Pairs of the shared rope key to compare: an eighth, a quarter and three eighths of the cut's values per
    token per layer; beside a given latent width, head_dim / 16, / 8 and / 4 pairs."""
    shape = attention_shape(source_config)
    head_dim, key_heads = shape.head_dim, shape.key_heads
    if options.kv_cut is None:
        return sorted({max(1, head_dim // 16), max(1, head_dim // 8), max(1, head_dim // 4)})
    values = cut_values(source_config, options.kv_cut)
    pairs = {shared_key_pairs(values, share) for share in ROPE_SHARES}
    return sorted(count for count in pairs if count <= key_heads * head_dim // 2 and 2 * count < values)


def shared_key_pairs(values: int, share: float) -> int:
    """The rotary pairs of a shared rope key that takes `share` of `values` per token per layer (at least one)."""
    return max(1, round(values * share / 2))


def candidates(source_config, options: ConversionOptions) -> list[ConversionOptions]:
    """One shared rope key of each width of `rope_pair_choices` (a given split, or a given width, leaves nothing to
    choose)."""
    if options.rope_split != "auto":
        return [options]
    pairs = rope_pair_choices(source_config, options)
    if not pairs:
        raise ValueError(
            f"A {options.kv_cut:.2%} cut leaves no room for a rope key beside a latent: lower kv_cut, or choose "
            "rope_split='exact'."
        )
    return [dataclasses.replace(options, rope_split="shared", rope_pairs=count) for count in pairs]


def decode_path(options: ConversionOptions) -> str:
    """How a model converted with `options` decodes (what its speed and serving depend on)."""
    if options.rope_split == "exact":
        return "rebuilt: every cached latent re-expanded, keys rotated, each step"
    if options.gate_position == "kv" and options.gate_embedding_dim > 0:
        return "rebuilt: every cached latent re-expanded each step (gate on K/V)"
    return "absorbed MQA over [latent ; rope key] (vLLM's MLA layer serves it)"


def candidate_cost(student_config, choice: ConversionOptions, source_config) -> dict:
    """The decode cost of `choice` (converted gate-free for the search) with the gate it will really have."""
    config = copy.deepcopy(student_config)
    config.gate_embedding_dim, config.gate_position = choice.gate_embedding_dim, choice.gate_position
    config.num_key_value_heads = student_key_heads(source_config, choice)
    return cost_row(egmla_cost(config), source_cost(source_config))


def held_out_split(blocks: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the blocks the candidates are calibrated on, the last few, packed as long as `context` allows up to 512)."""
    if len(blocks) < 2:
        raise ValueError("rope_split='auto' needs at least 2 calibration blocks (one held out to compare on).")
    held_out_count = max(1, min(HELD_OUT_BLOCKS, len(blocks) // 8))
    fit, held_out = blocks[:-held_out_count], blocks[-held_out_count:]
    # Scored on blocks as long as the source's context allows: partial RoPE loses most at long distances.
    length = min(context, LONGEST_SCORED_BLOCK)
    return fit, packed_blocks(held_out, length) if held_out.numel() >= length else held_out


def candidate_row(choice: ConversionOptions, budget, perplexity_value: float, cost: dict) -> dict:
    """A candidate's row of the report's table."""
    return {
        "candidate": describe(choice, budget.kv_lora_rank),
        "rope_split": choice.rope_split,
        "rope_pairs": None if choice.rope_split == "exact" else budget.rope_pairs,
        "kv_lora_rank": budget.kv_lora_rank,
        "values_per_token_per_layer": budget.values_per_token_per_layer,
        "perplexity": perplexity_value,
        "decode": decode_path(choice),
        "cost": cost,
    }


@dataclass
class CandidateStream:
    """One candidate split, the plan of its gate-free form as the search converts it (a layer added as each goes
    by), and its residual stream over the held-out blocks [M, L, D] on the host."""

    choice: ConversionOptions
    plan: ConversionPlan
    hidden: torch.Tensor

    def config(self, source_model):
        return layer_config(source_model, self.plan)


def candidate_stream(source_config, choice: ConversionOptions, hidden: torch.Tensor) -> CandidateStream:
    """The search converts without the gate (it starts as the identity, and its tables span layers)."""
    options = dataclasses.replace(choice, gate_embedding_dim=0, gate_position="latent")
    return CandidateStream(choice, ConversionPlan(options, resolve_budget(source_config, options)), hidden)


@torch.no_grad()
def advance(candidate: CandidateStream, source_model, layer, layer_idx: int, statistics: LayerStatistics) -> None:
    """The candidate's conversion of `layer` in closed form, and its stream moved past it."""
    state, _ = convert_layer(source_model, layer, layer_idx, statistics, candidate.plan)
    student, rotary = student_layer(state, layer_idx, candidate.config(source_model), layer.input_layernorm.weight)
    candidate.hidden = student_layer_output(student, candidate.hidden, rotary)


def candidate_streams(source: LayerSource, choices: list, blocks: torch.Tensor, keep: Callable) -> tuple:
    """Every layer calibrated on `blocks` but the held-out few (its statistics given to `keep(layer_idx,
    statistics)`), each candidate's stream and the source's advanced past it: (the candidates, the source's
    stream, the held-out blocks)."""
    config = source.config
    fit, held_out = held_out_split(blocks, config.max_position_embeddings)
    embeddings = source.embeddings()
    hidden, source_stream = (torch.nn.functional.embedding(ids, embeddings) for ids in (fit, held_out))
    streams = [candidate_stream(config, choice, source_stream.clone()) for choice in choices]
    for layer_idx in tqdm(range(config.num_hidden_layers), desc="searching the split", unit="layer", leave=False):
        layer = source.layer(layer_idx)
        rotary = source.rotary(layer)
        statistics, hidden = run_layer(layer, hidden, rotary)
        keep(layer_idx, statistics)
        for candidate in streams:
            advance(candidate, source.model, layer, layer_idx, statistics)
        _, source_stream = run_layer(layer, source_stream, rotary, record=False)
        del layer  # a layer read from files is freed before the next one is read
    return streams, source_stream, held_out


def choose_split(
    source: LayerSource, options: ConversionOptions, blocks: torch.Tensor, keep: Callable
) -> tuple[ConversionOptions, list[dict]]:
    """(the best candidate's options, every candidate's row: its held-out perplexity, zero-shot, and its decode
    cost). With nothing to choose: (the options, []), and nothing calibrated."""
    config = source.config
    choices = candidates(config, options)
    if len(choices) == 1:
        return choices[0], []
    streams, source_stream, held_out = candidate_streams(source, choices, blocks, keep)
    norm, head = source.norm_and_head()
    costs = source_cost(config)
    rows = [{"candidate": "source", "perplexity": stream_perplexity(source_stream, held_out, norm, head),
             "cost": cost_row(costs, costs)}]  # fmt: skip
    for candidate in streams:
        cost = candidate_cost(candidate.config(source.model), candidate.choice, config)
        value = stream_perplexity(candidate.hidden, held_out, norm, head)
        rows.append(candidate_row(candidate.choice, candidate.plan.budget, value, cost))
    best = min(range(len(choices)), key=lambda index: rows[index + 1]["perplexity"])
    rows[best + 1]["chosen"] = True
    return choices[best], rows


def describe(options: ConversionOptions, kv_lora_rank: int) -> str:
    if options.rope_split == "exact":
        return f"RoPE-exact latent of {kv_lora_rank}"
    return f"rope key of {options.rope_pairs} pairs + latent of {kv_lora_rank}"
