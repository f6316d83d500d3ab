"""The default split (`rope_split="auto"`): with only a budget given, convert a few absorbable ways at that budget (a
decoupled rope key of a few widths, the latent taking the rest), score each on a held-out slice of the calibration
blocks, and keep the best. Every candidate's perplexity goes into the report beside its decode cost against the
source (values read and multiply-adds per cached token per layer), so a user can trade quality for decode speed
knowingly. The rebuilding RoPE-exact latent is converted only when asked for by name (`rope_split="exact"`): it keeps
RoPE exact but rebuilds every cached key at every step, several times the source's arithmetic."""

import copy
import dataclasses

import torch
from transformers import LlamaForCausalLM

from ..text import packed_blocks, perplexity
from .calibration import LayerStatistics, calibrate
from .convert import ConversionOptions, build_student, cut_values, plan_layers, student_key_heads
from .decode_cost import cost_row, egmla_cost, source_cost
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


def candidates(teacher: LlamaForCausalLM, options: ConversionOptions) -> list[ConversionOptions]:
    """One shared rope key of each width of `rope_pair_choices` (a given mode, or given rope-key flags, leave
    nothing to choose)."""
    if options.rope_split != "auto":
        return [options]
    pairs = rope_pair_choices(teacher.config, options)
    if not pairs:
        raise ValueError(
            f"A {options.kv_cut:.2%} cut leaves no room for a rope key beside a latent: lower kv_cut, or choose "
            "rope_split='exact'."
        )
    return [dataclasses.replace(options, rope_split="shared", rope_pairs=count) for count in pairs]


def decode_path(options: ConversionOptions) -> str:
    """How a model converted with `options` decodes (what its speed and serving depend on)."""
    if options.rope_mode == "exact":
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
        "rope_pairs": None if choice.rope_mode == "exact" else budget.rope_pairs,
        "kv_lora_rank": budget.kv_lora_rank,
        "values_per_token_per_layer": budget.values_per_token_per_layer,
        "perplexity": perplexity_value,
        "decode": decode_path(choice),
        "cost": cost,
    }


def choose_split(
    teacher: LlamaForCausalLM, options: ConversionOptions, blocks: torch.Tensor
) -> tuple[ConversionOptions, list[dict], list[LayerStatistics]]:
    """(the best candidate's options, every candidate's row, the statistics to convert with). Calibrates once on
    the blocks but the last few, scores each candidate on those, zero-shot."""
    choices = candidates(teacher, options)
    if len(choices) == 1:
        return choices[0], [], calibrate(teacher, blocks)
    fit, held_out = held_out_split(blocks, teacher.config.max_position_embeddings)
    statistics = calibrate(teacher, fit)
    source = source_cost(teacher.config)
    rows = [{"candidate": "source", "perplexity": perplexity(teacher, held_out), "cost": cost_row(source, source)}]
    for choice in choices:
        plan = plan_layers(teacher, dataclasses.replace(choice, gate_embedding_dim=0), statistics)
        student = build_student(teacher, plan)
        cost = candidate_cost(student.config, choice, teacher.config)
        rows.append(candidate_row(choice, plan.budget, perplexity(student, held_out), cost))
    best = min(range(len(choices)), key=lambda index: rows[index + 1]["perplexity"])
    rows[best + 1]["chosen"] = True
    return choices[best], rows, statistics


def describe(options: ConversionOptions, kv_lora_rank: int) -> str:
    if options.rope_mode == "exact":
        return f"RoPE-exact latent of {kv_lora_rank}"
    return f"rope key of {options.rope_pairs} pairs + latent of {kv_lora_rank}"
