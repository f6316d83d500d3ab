"""A fitted gate: the gate tables and W^{UE} set from calibration so that, per token, the gate rescales what the
latent rebuilds toward the source's keys and values (EG-MLA's own lever at conversion; the identity gate is left
for the fine-tuning to find otherwise).

Per layer, on the source's attention inputs x of the calibration blocks, with u = W^{UKV} c the rebuilt K/V of the
latent c and y the source's (in the student's layout): per token v and channel j, the least-squares scale
g = sum u y / sum u^2 over the token's positions, shrunk toward 1 by `shrinkage` pseudo-positions of the channel's
mean energy, so that a rare token keeps nearly the identity. Then g - 1 [tokens, channels] is factorised by a truncated SVD weighted by the tokens' counts
and the channels' mean energy into table rows x W^{UE} of width gate_embedding_dim; tokens never seen get zero rows
(the identity gate). A table whose fitted gate would not lower the attention output error of its layers stays as
it was.

Only the gate on K/V is fitted. For the gate on the latent the closed form has nothing to fix: in the metric the
factorization minimises (whitened inputs, errors weighted by where they reach the output), each position's latent
is already the optimal projection, so the least-squares scale of every latent dim is 1 (on stories260K, fitted in
the unweighted metric instead, it raised every layer's attention error and the held-out perplexity: docs/results.md#behind-the-defaults).
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import LlamaForCausalLM

from ..modeling_egmla import EGMLAForCausalLM, look_up_gate_rows
from .calibration import SourceLayer, source_layers
from .convert import ConversionPlan, source_rows, stacked_rows
from .families import layer_mask
from .source import attention_shape

ERROR_BLOCKS = 16  # calibration blocks the attention error is compared on (the least squares uses them all)


class GateStatistics(NamedTuple):
    """One layer's per-token sums over the calibration positions ([U] distinct tokens of the blocks)."""

    gram: torch.Tensor  # [U, C] sum u^2
    cross: torch.Tensor  # [U, C] sum u y
    mean_energy: torch.Tensor  # [C] the channel's mean u^2 per position (shrinkage, weights)
    target_energy: float  # sum |y|^2, so that errors are absolute


@torch.no_grad()
def attention_error(attention, table, inputs: SourceLayer, blocks: torch.Tensor, rotary) -> float:
    """|student attention - source attention|^2 of one layer (`attention`, its gate `table`, the student's `rotary`)
    on the source's inputs (its first ERROR_BLOCKS blocks): what decides between the fitted gate and the identity
    (the K/V error the fit lowers weighs every channel alike)."""
    inputs, blocks = SourceLayer(*(tensor[:ERROR_BLOCKS] for tensor in inputs)), blocks[:ERROR_BLOCKS]
    (gate_rows,) = look_up_gate_rows(torch.nn.ModuleList([table]), blocks.to(inputs.normed.device))
    position_embeddings = rotary(inputs.normed, torch.arange(blocks.shape[1], device=inputs.normed.device)[None])
    mask = layer_mask(attention, blocks.shape[1], inputs.normed.dtype, inputs.normed.device)  # a windowed layer's
    output, _ = attention(inputs.normed, position_embeddings, mask, gate_rows=gate_rows)
    return (output - inputs.attention).double().square().sum().item()


def gate_statistics(attention, inputs: torch.Tensor, target_rows: torch.Tensor, index: torch.Tensor, distinct: int):
    """The sums of one layer: `inputs` [T, D], `target_rows` [C, D] (the source's K/V rows per student head),
    `index` [T] each position's distinct-token row."""
    down, rank = attention.kv_a_proj_with_mqa, attention.kv_lora_rank
    latent = F.linear(inputs, down.weight[:rank], None if down.bias is None else down.bias[:rank])  # [T, r]
    rebuilt = (latent @ attention.kv_b_proj.weight.T).double()  # [T, C]
    biased = target_rows.shape[1] > inputs.shape[1]  # a biased source's rows end with their bias column
    target = F.linear(inputs, target_rows[:, : inputs.shape[1]], target_rows[:, -1] if biased else None).double()
    gram = rebuilt.new_zeros(distinct, rebuilt.shape[1]).index_add_(0, index, rebuilt.square())
    cross = rebuilt.new_zeros(distinct, rebuilt.shape[1]).index_add_(0, index, rebuilt * target)
    return GateStatistics(gram, cross, gram.sum(0) / len(inputs), target.square().sum().item())


def least_squares_gate(statistics: GateStatistics, shrinkage: float) -> torch.Tensor:
    """Per token and channel, the shrunk least-squares gate [U, C]."""
    prior = shrinkage * statistics.mean_energy
    return (statistics.cross + prior) / (statistics.gram + prior).clamp(min=1e-30)


def squared_error(statistics: GateStatistics, gate: torch.Tensor) -> float:
    """sum |u * g - y|^2 over the calibration positions for a per-token gate [U, C] (1 everywhere: no gate)."""
    quadratic = (statistics.gram * gate.double().square()).sum()
    return (quadratic - 2 * (statistics.cross * gate.double()).sum()).item() + statistics.target_energy


def factorised_gate(delta: torch.Tensor, counts: torch.Tensor, channel_weights: torch.Tensor, width: int):
    """delta = g - 1 [U, C] ~ rows [U, width] x weight.T, weighted by sqrt(counts) per row and sqrt(channel
    weight) per column; (rows, weight [C, width])."""
    row_scale = counts.to(delta.device).double().sqrt()[:, None]  # the counts stay on the host with the blocks
    column_scale = channel_weights.double().clamp(min=1e-30).sqrt()
    left, singular, right = torch.linalg.svd(delta.double() * row_scale * column_scale, full_matrices=False)
    width = min(width, len(singular))
    root = singular[:width].sqrt()
    return left[:, :width] * root / row_scale, (right[:width].T * root) / column_scale[:, None]


class GateFit(NamedTuple):
    """What every table's fit reads of the calibration blocks."""

    blocks: torch.Tensor  # the calibration blocks [N, S]
    tokens: torch.Tensor  # [U] their distinct token ids
    index: torch.Tensor  # [N * S] each position's row of `tokens`
    counts: torch.Tensor  # [U] their positions
    shrinkage: float


def gate_fit(blocks: torch.Tensor, shrinkage: float) -> GateFit:
    tokens, index = torch.unique(blocks.flatten(), return_inverse=True)
    return GateFit(blocks, tokens, index, torch.bincount(index, minlength=len(tokens)), shrinkage)


class GateLayer(NamedTuple):
    """One layer a table is fitted over: its student attention, the source's inputs to it, and their sums."""

    attention: torch.nn.Module
    inputs: SourceLayer
    sums: GateStatistics


@torch.no_grad()
def gate_layer(attention, source_attention, split, inputs: SourceLayer, fit: GateFit) -> GateLayer:
    """The sums of the student `attention` against `source_attention` (the source layer's, with the layer's rope
    `split`) on the source's `inputs`."""
    source_key_heads = attention_shape(source_attention.config).key_heads
    group = attention.config.num_key_value_heads // source_key_heads
    stacked = stacked_rows(split, source_rows(source_attention)[2])
    target_rows = stacked.float().view(source_key_heads, -1, stacked.shape[1])
    target_rows = target_rows.repeat_interleave(group, dim=0).flatten(0, 1).to(inputs.normed.device)  # per key head
    normed = inputs.normed.flatten(0, 1)
    sums = gate_statistics(attention, normed, target_rows, fit.index.to(normed.device), len(fit.tokens))
    return GateLayer(attention, inputs, sums)


def fit_gate(
    student: EGMLAForCausalLM,
    source: LlamaForCausalLM,
    blocks: torch.Tensor,
    plan: ConversionPlan,
    shrinkage: float,
) -> list[dict]:
    """Sets the gate tables and W^{UE} of a built `student` in place (see the module docstring), as the conversion's
    layer pass sets each layer's; per table, the K/V error and the attention output error of its layers with the
    identity gate and with the fitted one."""
    config = student.config
    if not config.gate_enabled or config.gate_position != "kv":
        return []
    fit, pending, rows = gate_fit(blocks, shrinkage), [], []
    layers = zip(source.model.layers, source_layers(source, blocks), plan.layers, strict=True)
    for layer_idx, (layer, inputs, planned) in enumerate(
        tqdm(layers, desc="fitting the gate", unit="layer", total=config.num_hidden_layers, leave=False)
    ):
        attention = student.model.layers[layer_idx].self_attn
        pending.append(gate_layer(attention, layer.self_attn, planned.split, inputs, fit))
        if len(pending) == config.gate_layers_per_table:
            table = student.model.gate_embeddings[layer_idx // config.gate_layers_per_table]
            rows.append(set_table(table, pending, student.model.rotary_of(layer_idx), fit))  # one layer a table
            pending = []
    return rows


@torch.no_grad()
def set_table(table, layers: list[GateLayer], rotary, fit: GateFit) -> dict:
    """Fits one gate table jointly over the layers that share it and the W^{UE} of those layers; keeps the fit only
    where it lowers the layers' attention output error."""
    sums = [layer.sums for layer in layers]
    gates = [least_squares_gate(layer_sums, fit.shrinkage) for layer_sums in sums]
    channel_weights = torch.cat([layer_sums.mean_energy for layer_sums in sums])
    table_rows, weight = factorised_gate(torch.cat(gates, dim=1) - 1, fit.counts, channel_weights, table.embedding_dim)
    widths = [gate.shape[1] for gate in gates]
    fitted = (1 + table_rows @ weight.T).split(widths, dim=1)
    projections = [layer.attention.gate_embedding_proj for layer in layers]
    saved = [table.weight.clone()] + [projection.weight.clone() for projection in projections]

    def error() -> float:
        return sum(attention_error(layer.attention, table, layer.inputs, fit.blocks, rotary) for layer in layers)

    before = error()
    table.weight.zero_()  # tokens the calibration never saw: the identity gate
    table.weight[fit.tokens.to(table.weight.device), : table_rows.shape[1]] = table_rows.to(table.weight)
    for projection, layer_weight in zip(projections, weight.split(widths, dim=0), strict=True):
        projection.weight.zero_()
        projection.weight[:, : layer_weight.shape[1]] = layer_weight.to(projection.weight)
    after = error()
    if after >= before:
        for parameter, value in zip([table.weight] + [p.weight for p in projections], saved, strict=True):
            parameter.copy_(value)
    return {
        "layers": [layer.attention.layer_idx for layer in layers],
        "kv_error": sum(
            squared_error(layer_sums, torch.ones_like(gate)) for layer_sums, gate in zip(sums, gates, strict=True)
        ),
        "kv_error_fitted": sum(squared_error(layer_sums, gate) for layer_sums, gate in zip(sums, fitted, strict=True)),
        "attention_error": before,
        "attention_error_fitted": after,
        "fitted": after < before,
    }
