"""The split search of a streamed conversion (`egmla convert --stream`, `rope_split="auto"`): the whole-model search
(`search.py`) one layer at a time. As each source layer streams by, it is calibrated on the search's calibration
blocks, every candidate split converts it in closed form, and each candidate's own residual stream over the held-out
blocks advances through its converted layer beside the source's; at the end the final norm and the head score every
stream, and the best candidate is the split. The statistics go to a folder on disk, one file a layer, so that the
conversion that follows reads them instead of calibrating again and memory still holds one layer."""

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .calibration import LayerStatistics
from .convert import Budget, ConversionOptions, ConversionPlan, factorize_layer, resolve_budget
from .decode_cost import cost_row, source_cost
from .layer_stream import (
    SourceFiles,
    final_norm_and_head,
    layer_config,
    run_layer,
    source_layer,
    student_layer,
    student_layer_output,
    student_layer_state,
)
from .search import candidate_cost, candidate_row, candidates, held_out_split


@dataclass
class CandidateStream:
    """One candidate split and its residual stream over the held-out blocks [M, L, D], on the host."""

    options: ConversionOptions
    budget: Budget
    hidden: torch.Tensor
    frequencies: list = field(default_factory=list)  # each converted layer's rope frequencies

    def config(self, shell):
        return layer_config(shell, self.options, self.budget, self.frequencies)


def statistics_file(folder: Path, layer_idx: int) -> Path:
    return folder / f"layer-{layer_idx:05d}.pt"


def save_statistics(statistics: LayerStatistics, folder: Path, layer_idx: int) -> None:
    torch.save(dataclasses.asdict(statistics), statistics_file(folder, layer_idx))


def load_statistics(folder: Path, layer_idx: int) -> LayerStatistics:
    return LayerStatistics(**torch.load(statistics_file(folder, layer_idx), weights_only=True))


@torch.no_grad()
def advance(candidate: CandidateStream, shell, layer, layer_idx: int, statistics: LayerStatistics, inv_freq) -> None:
    """The candidate's conversion of `layer` in closed form, and its stream moved past it."""
    split, factorization = factorize_layer(layer.self_attn, statistics, inv_freq, candidate.budget, candidate.options)
    plan = ConversionPlan(candidate.options, candidate.budget, [], [], [])
    converted = (split, factorization.truncate(candidate.budget.kv_lora_rank))
    state = student_layer_state(shell, layer, layer_idx, converted, plan)
    candidate.frequencies.append(split.frequencies)
    student, rotary = student_layer(state, layer_idx, candidate.config(shell), layer.input_layernorm.weight)
    candidate.hidden = student_layer_output(student, candidate.hidden, rotary)


@torch.no_grad()
def stream_perplexity(hidden: torch.Tensor, blocks: torch.Tensor, norm: torch.nn.Module, head: torch.Tensor) -> float:
    """Next-token perplexity of a final residual stream [M, L, D] over its blocks [M, L], a block at a time."""
    total = 0.0
    for states, ids in zip(hidden, blocks, strict=True):
        logits = torch.nn.functional.linear(norm(states.to(head.device)), head).float()
        total += torch.nn.functional.cross_entropy(logits[:-1], ids[1:].to(head.device)).item()
    return math.exp(total / len(blocks))


def streamed_split_search(shell, files: SourceFiles, job, blocks: torch.Tensor, folder: Path) -> tuple:
    """(the chosen options, every candidate's row as the whole-model search reports it); the statistics of every
    layer saved in `folder`. With nothing to choose: (the options, []) and nothing saved."""
    config, placement = shell.config, job.placement
    choices = candidates(shell, job.options)
    if len(choices) == 1:
        return choices[0], []
    fit, held_out = held_out_split(blocks, config.max_position_embeddings)
    embeddings = files.read("model.embed_tokens.")["weight"].to(placement.torch_dtype)
    hidden, source = (torch.nn.functional.embedding(ids, embeddings) for ids in (fit, held_out))
    streams = [CandidateStream(choice, resolve_budget(config, choice), source.clone()) for choice in choices]
    inv_freq = shell.model.rotary_emb.inv_freq.float().cpu()
    for layer_idx in tqdm(range(config.num_hidden_layers), desc="searching the split", unit="layer", leave=False):
        layer = source_layer(shell, files, layer_idx, placement)
        rotary = shell.model.rotary_emb.to(layer.input_layernorm.weight.device)
        statistics, hidden = run_layer(layer, hidden, rotary)
        save_statistics(statistics, folder, layer_idx)
        for candidate in streams:
            advance(candidate, shell, layer, layer_idx, statistics, inv_freq)
        _, source = run_layer(layer, source, rotary, record=False)
        del layer
    outer = files.read("", outside_layers=True)
    norm, head = final_norm_and_head(shell, outer, placement.torch_device(), placement.torch_dtype)
    costs = source_cost(config)
    rows = [{"candidate": "source", "perplexity": stream_perplexity(source, held_out, norm, head),
             "cost": cost_row(costs, costs)}]  # fmt: skip
    for candidate in streams:
        cost = candidate_cost(candidate.config(shell), candidate.options, config)
        value = stream_perplexity(candidate.hidden, held_out, norm, head)
        rows.append(candidate_row(candidate.options, candidate.budget, value, cost))
    best = min(range(len(choices)), key=lambda index: rows[index + 1]["perplexity"])
    rows[best + 1]["chosen"] = True
    return choices[best], rows
