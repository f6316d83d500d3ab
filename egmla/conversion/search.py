"""The default split (`rope_mode="auto"`): with only a budget given, convert a few ways at that budget (the RoPE-exact
latent; a decoupled rope key of a few widths, the latent taking the rest), score each on a held-out slice of the
calibration blocks, and keep the best. Every candidate's perplexity goes into the report beside the decode path it
implies, so a user can trade quality for decode speed knowingly."""

import dataclasses

import torch
from transformers import LlamaForCausalLM

from ..text import perplexity
from .calibration import LayerStatistics, calibrate
from .convert import ConversionOptions, convert_llama_to_egmla, resolve_budget

HELD_OUT_BLOCKS = 8  # at most: a slice of the calibration blocks that the candidates are not fitted on


def candidates(teacher: LlamaForCausalLM, options: ConversionOptions) -> list[ConversionOptions]:
    """The RoPE-exact latent, and one shared rope key of head_dim / 16, / 8 and / 4 pairs (a given mode, or
    given rope-key flags, leave nothing to choose)."""
    if options.rope_mode != "auto":
        return [options]
    head_dim = teacher.config.head_dim
    pairs = sorted({max(1, head_dim // 16), max(1, head_dim // 8), max(1, head_dim // 4)})
    return [dataclasses.replace(options, rope_mode="exact")] + [
        dataclasses.replace(options, rope_mode="decoupled", rope_pairs=count) for count in pairs
    ]


def decode_path(options: ConversionOptions) -> str:
    """How a model converted with `options` decodes (what its speed and serving depend on)."""
    if options.rope_mode == "exact":
        return "re-expansion of every cached latent, keys rotated, each step"
    if options.gate_position == "kv" and options.gate_embedding_dim > 0:
        return "re-expansion of every cached latent, each step (gate on K/V)"
    return "absorbed MQA over [latent ; rope key] (vLLM's MLA layer can serve it)"


def choose_split(
    teacher: LlamaForCausalLM, options: ConversionOptions, blocks: torch.Tensor
) -> tuple[ConversionOptions, list[dict], list[LayerStatistics]]:
    """(the best candidate's options, every candidate's row, the statistics to convert with). Calibrates once on
    the blocks but the last few, scores each candidate on those, zero-shot."""
    choices = candidates(teacher, options)
    if len(choices) == 1:
        return choices[0], [], calibrate(teacher, blocks)
    if len(blocks) < 2:
        raise ValueError("rope_mode='auto' needs at least 2 calibration blocks (one held out to compare on).")
    held_out_count = max(1, min(HELD_OUT_BLOCKS, len(blocks) // 8))
    fit, held_out = blocks[:-held_out_count], blocks[-held_out_count:]
    statistics = calibrate(teacher, fit)
    rows = [{"candidate": "source", "perplexity": perplexity(teacher, held_out)}]
    for choice in choices:
        budget = resolve_budget(teacher.config, choice)
        student = convert_llama_to_egmla(teacher, dataclasses.replace(choice, gate_embedding_dim=0), statistics)
        rows.append(
            {
                "candidate": describe(choice, budget.kv_lora_rank),
                "rope_mode": choice.rope_mode,
                "rope_pairs": None if choice.rope_mode == "exact" else budget.rope_pairs,
                "kv_lora_rank": budget.kv_lora_rank,
                "values_per_token_per_layer": budget.values_per_token_per_layer,
                "perplexity": perplexity(student, held_out),
                "decode": decode_path(choice),
            }
        )
    best = min(range(len(choices)), key=lambda index: rows[index + 1]["perplexity"])
    rows[best + 1]["chosen"] = True
    return choices[best], rows, statistics


def describe(options: ConversionOptions, kv_lora_rank: int) -> str:
    if options.rope_mode == "exact":
        return f"RoPE-exact latent of {kv_lora_rank}"
    return f"rope key of {options.rope_pairs} pairs + latent of {kv_lora_rank}"
