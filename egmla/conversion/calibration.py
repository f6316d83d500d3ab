"""Calibration: what conversion needs to know of the source's activations, per layer (the covariance of the
attention inputs and the mean 2-norm of every rotary pair of the queries and keys)."""

from dataclasses import dataclass
from typing import NamedTuple

import torch
from tqdm.auto import tqdm
from transformers import LlamaForCausalLM

from .families import attention_added, layer_mask, layer_rotary, mlp_block, norm_eps, norm_weight
from .source import attention_shape


@dataclass
class LayerStatistics:
    """What conversion needs from calibration data, for one layer."""

    covariance: torch.Tensor  # [D, D] float64, E[x x^T] of the attention input
    query_pair_norms: torch.Tensor  # [Hq, hd/2] mean 2-norm of each rotary pair of every query head
    key_pair_norms: torch.Tensor  # [Hkv, hd/2]
    context_length: int  # the query-key distances the pairs are ranked over: the fitted length
    tokens: int
    mean: torch.Tensor | None = None  # [D] float64, E[x]: what a source's biases (a constant input) correlate with

    def with_bias_input(self) -> torch.Tensor:
        """E[x' x'^T] [D+1, D+1] of the input with a constant 1 appended, on which a bias is one more weight column."""
        mean = self.mean if self.mean is not None else self.covariance.new_zeros(len(self.covariance))
        top = torch.cat([self.covariance, mean[:, None]], dim=1)
        return torch.cat([top, torch.cat([mean, mean.new_ones(1)])[None]])


# What a conversion calibrates on: token blocks [N, S], statistics from `calibrate`, or nothing (weights only).
Calibration = torch.Tensor | list[LayerStatistics] | None


def pair_norms(states: torch.Tensor, heads: int) -> torch.Tensor:
    """states [N, heads*hd] -> summed 2-norm of each rotary pair (dims j and j + hd/2) [heads, hd/2]."""
    states = states.view(states.shape[0], heads, 2, -1)  # half-split: [N, heads, (first, second half), hd/2]
    # hypot of the two halves: far faster on a CPU than a norm over a middle dimension of size 2
    return torch.hypot(states[:, :, 0], states[:, :, 1]).sum(dim=0)


def normed_heads(norm: torch.nn.Module | None, states: torch.Tensor, heads: int) -> torch.Tensor:
    """A QK-norm source's per-head norm of `states` [N, heads*hd] in float32 (none: `states` as they are)."""
    if norm is None:
        return states
    shaped = states.view(len(states), heads, -1)
    normed = torch.nn.functional.rms_norm(shaped, shaped.shape[-1:], norm_weight(norm).float(), norm_eps(norm))
    return normed.view(len(states), -1)


def float_projection(linear: torch.nn.Linear, inputs: torch.Tensor) -> torch.Tensor:
    """A projection of float32 inputs in float32 whatever the weights' dtype (statistics are kept in float32/64)."""
    bias = None if linear.bias is None else linear.bias.float()
    return torch.nn.functional.linear(inputs, linear.weight.float(), bias)


class StatisticsRecorder:
    """A forward pre-hook on one source layer's `q_proj` that sums what `LayerStatistics` holds of its inputs."""

    def __init__(self, attention: torch.nn.Module):
        config, shape = attention.config, attention_shape(attention.config)
        self.attention, self.heads, self.key_heads = attention, shape.query_heads, shape.key_heads
        self.covariance = torch.zeros(config.hidden_size, config.hidden_size, dtype=torch.float64)
        self.sums = torch.zeros(config.hidden_size, dtype=torch.float64)
        self.query_norms = torch.zeros(self.heads, shape.head_dim // 2)
        self.key_norms = torch.zeros(self.key_heads, shape.head_dim // 2)
        self.count = 0

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        inputs = args[0].reshape(-1, args[0].shape[-1]).float()  # the normed hidden states entering q/k/v
        self.covariance += (inputs.T.double() @ inputs.double()).cpu()
        self.sums += inputs.double().sum(0).cpu()
        # The projections by their weights: calling q_proj here would re-enter this hook.
        # The queries and keys RoPE turns: a QK-norm source's after their norms.
        queries = normed_heads(
            getattr(self.attention, "q_norm", None), float_projection(self.attention.q_proj, inputs), self.heads
        )
        keys = normed_heads(
            getattr(self.attention, "k_norm", None), float_projection(self.attention.k_proj, inputs), self.key_heads
        )
        self.query_norms += pair_norms(queries, self.heads).cpu()
        self.key_norms += pair_norms(keys, self.key_heads).cpu()
        self.count += inputs.shape[0]

    def statistics(self) -> LayerStatistics:
        return LayerStatistics(
            covariance=self.covariance / self.count,
            query_pair_norms=self.query_norms / self.count,
            key_pair_norms=self.key_norms / self.count,
            context_length=fitted_context(self.attention.config),
            tokens=self.count,
            mean=self.sums / self.count,
        )


@torch.no_grad()
def calibrate(model: LlamaForCausalLM, blocks: torch.Tensor, batch_size: int = 8) -> list[LayerStatistics]:
    """Runs the source on token blocks [N, S] and collects per-layer statistics of the attention inputs."""
    recorders = [StatisticsRecorder(layer.self_attn) for layer in model.model.layers]
    handles = [
        layer.self_attn.q_proj.register_forward_pre_hook(recorder)
        for layer, recorder in zip(model.model.layers, recorders, strict=True)
    ]
    try:
        device = next(model.parameters()).device
        for start in tqdm(range(0, len(blocks), batch_size), desc="calibrating", unit="batch", leave=False):
            model.model(blocks[start : start + batch_size].to(device), use_cache=False)  # no head: no logits needed
    finally:
        for handle in handles:
            handle.remove()
    return [recorder.statistics() for recorder in recorders]


# The length the fitting stages train on (the layer-wise fit's and recovery's packed blocks) on a CPU.
FITTED_CONTEXT = 512


def fitted_context(config) -> int:
    """The query-key distances over which rotary pairs are ranked: the length the fitting stages train on (the
    source's context, at most 512), so that what the split leaves out is what those stages can fit: ranked over
    the whole context, SmolLM2's layer-wise fit ended further from its source (docs/results.md#behind-the-defaults)."""
    return min(config.max_position_embeddings, FITTED_CONTEXT)


def normed_weight(attention: torch.nn.Module, which: str) -> torch.Tensor:
    """The query's or key's projection weight [D, heads*hd], each column times its QK-norm weight where the source
    has one."""
    weight = getattr(attention, f"{which}_proj").weight.detach().T
    norm = getattr(attention, f"{which}_norm", None)
    return weight if norm is None else weight * norm_weight(norm).repeat(weight.shape[1] // len(norm.weight))


def weight_statistics(model: LlamaForCausalLM) -> list[LayerStatistics]:
    """Without calibration data the choices fall back to the weights alone: an identity covariance, pair norms of
    the projection weights, and distances up to the fitted length (the source's context, at most 512)."""
    config, shape = model.config, attention_shape(model.config)
    context_length = fitted_context(config)
    return [
        LayerStatistics(
            covariance=torch.eye(config.hidden_size, dtype=torch.float64),
            query_pair_norms=pair_norms(normed_weight(layer.self_attn, "q"), shape.query_heads),
            key_pair_norms=pair_norms(normed_weight(layer.self_attn, "k"), shape.key_heads),
            context_length=context_length,
            tokens=0,
        )
        for layer in model.model.layers
    ]


def layer_statistics(model: LlamaForCausalLM, calibration: Calibration) -> list[LayerStatistics]:
    """Statistics from whichever calibration input was given."""
    if calibration is None:
        return weight_statistics(model)
    if isinstance(calibration, torch.Tensor):
        return calibrate(model, calibration)
    if len(calibration) != model.config.num_hidden_layers:
        raise ValueError(
            f"calibration holds statistics of {len(calibration)} layers; the source has "
            f"{model.config.num_hidden_layers}."
        )
    return list(calibration)


class SourceLayer(NamedTuple):
    """One layer of the source on calibration blocks, [N, S, D] each."""

    hidden: torch.Tensor  # the residual stream entering the layer
    normed: torch.Tensor  # its normed attention input
    attention: torch.Tensor  # the attention's output on it (before an output norm: `families.attention_added`)


@torch.no_grad()  # the source is never trained: its streams are targets, whatever its parameters' requires_grad
def source_attention(layer: torch.nn.Module, hidden: torch.Tensor, rotary) -> SourceLayer:
    """What one source decoder layer's attention reads and outputs on the residual stream `hidden` [N, S, D]."""
    normed = layer.input_layernorm(hidden)
    mask = layer_mask(layer.self_attn, hidden.shape[1], hidden.dtype, hidden.device)  # a windowed layer's
    return SourceLayer(hidden, normed, layer.self_attn(normed, rotary, mask)[0])


@torch.no_grad()
def source_layer_pass(layer: torch.nn.Module, hidden: torch.Tensor, rotary) -> tuple[SourceLayer, torch.Tensor]:
    """`source_attention`, and the stream after the whole layer."""
    inputs = source_attention(layer, hidden, rotary)
    return inputs, mlp_block(layer, hidden + attention_added(layer, inputs.attention))


@torch.no_grad()  # on a generator, torch switches grad off around each step only: the caller's mode is its own
def source_layers(model: LlamaForCausalLM, blocks: torch.Tensor):
    """Yields the source's `SourceLayer` of every layer, first to last, on token blocks [N, S]."""
    hidden = model.model.embed_tokens(blocks)
    positions = torch.arange(blocks.shape[1])[None]
    for layer_idx, layer in enumerate(model.model.layers):
        rotary = layer_rotary(model.model.rotary_emb, model.config, layer_idx)(hidden, positions)
        source, hidden = source_layer_pass(layer, hidden, rotary)
        yield source
