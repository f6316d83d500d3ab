"""Layer-wise reconstruction: after factorization, fit each converted attention block, first layer to last, so that
the student's residual stream after the block matches the source's on calibration blocks.

The student block reads the student's own residual stream (the already converted and fitted prefix), and its
target is the source's stream after the same block: it learns to undo the drift of the layers before it instead
of letting errors compound. Where the layer norms its attention's output (Gemma 3), that output cannot grow to undo
a drift, and the target is the source's block applied to the student's stream (`ReconstructionSettings.target`).
Only the block's parameters move (its projections, and its gate table and W^{UE} when the gate is on); the rest
stays the source's. A block whose fit does not lower its error keeps its closed-form weights.
"""

import contextlib
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from tqdm.auto import tqdm
from transformers import LlamaForCausalLM

from ..modeling_egmla import EGMLAForCausalLM, look_up_gate_rows
from ..options import check_fields, option
from ..precision import MIXED_PRECISIONS, fitting_autocast
from . import families
from .calibration import source_attention, source_layer_pass

GATE_INITS = ("least_squares", "identity")
FIT_TARGETS = ("auto", "stream", "block")


@dataclass(frozen=True)
class ReconstructionSettings:
    """The fitting after factorization: the gate's closed form (`gate.py`), then each attention block by Adam
    (`steps=0` turns that stage off)."""

    # One packed block a step. 150 steps, with 4 minutes of recovery, convert SmolLM2 with text within 10 minutes;
    # longer runs gained a little for more time (docs/results.md#behind-the-defaults).
    flag_prefix: ClassVar[str] = "reconstruction_"  # its flags: --reconstruction-steps, ...

    steps: int = option(150, "Adam steps per layer of the layer-wise fit (0: no layer-wise fit)", bounds="[0, inf)")
    batch_size: int = option(
        2,
        "calibration blocks per step of the layer-wise fit (before packing them to the recovery length)",
        bounds="[1, inf)",
    )
    # Relative: Adam moves each weight by about its step whatever the weight's size, and sources' weights differ in
    # size (docs/results.md#behind-the-defaults).
    learning_rate: float = option(
        5e-3,
        "learning rate of the layer-wise fit, relative to the RMS of each layer's query and output projections",
        bounds="(0, inf)",
    )
    fit_gate: bool = True  # fit the gate tables and W^{UE} too (False: the gate stays exactly the identity)
    gate_init: str = option(
        "least_squares",
        "the gate on K/V set by per-token least squares on the calibration text, or left at the identity",
        GATE_INITS,
    )
    # Results barely moved between 4 and 64 pseudo-positions (docs/results.md#behind-the-defaults).
    gate_shrinkage: float = option(16.0, "pseudo-positions pulling a rare token's gate toward 1", bounds="[0, inf)")
    mixed_precision: str = option(
        "auto", "the layer-wise fit's forward passes under bfloat16 autocast (see --mixed-precision)", MIXED_PRECISIONS
    )
    # What each block is fitted to. stream: the source's stream after the block (the block learns to undo the drift of
    # the layers before it); block: the source's block on the student's own stream; auto: block where the layer norms
    # its attention's output (Gemma 3: a normed output cannot grow to undo a drift), else stream.
    target: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self)
        if self.target not in FIT_TARGETS:
            raise ValueError(f"target must be one of {FIT_TARGETS}, got {self.target!r}.")

    def fits_the_block(self, source_layer: torch.nn.Module) -> bool:
        """Whether `source_layer`'s block is fitted to the source's block on the student's stream (`target`)."""
        if self.target == "auto":
            return families.output_norms(source_layer)[0] is not None
        return self.target == "block"


class LayerStreams(NamedTuple):
    """One layer's calibration data, [N, S, D] each."""

    student_in: torch.Tensor  # the student's residual stream entering the layer
    reference_in: torch.Tensor  # the stream the target's block read: the source's, or the student's (`target`)
    target: torch.Tensor  # the stream after the source's attention block


class StudentBlock(NamedTuple):
    """What one layer's fit reads and moves: the student's decoder layer and, with the gate on, its gate table."""

    layer: torch.nn.Module  # an EGMLADecoderLayer
    table: torch.nn.Module | None  # the layer's gate table (None: the gate is off)
    moves_table: bool  # a table shared by several layers moves with the first of them


def student_block(model: EGMLAForCausalLM, layer_idx: int) -> StudentBlock:
    config = model.config
    table = model.model.gate_embeddings[layer_idx // config.gate_layers_per_table] if config.gate_enabled else None
    return StudentBlock(model.model.layers[layer_idx], table, layer_idx % config.gate_layers_per_table == 0)


def student_attention(block: StudentBlock, hidden: torch.Tensor, token_ids, rotary) -> torch.Tensor:
    """The student's residual stream after the block's attention."""
    gate_rows = None
    if block.table is not None:
        (gate_rows,) = look_up_gate_rows(torch.nn.ModuleList([block.table]), token_ids)
    attention = block.layer.self_attn
    # SDPA is causal by itself where no window applies; eager (`fitting_attention`) adds the mask it is given, if any.
    causal = attention.config._attn_implementation == "eager"
    mask = families.layer_mask(attention, hidden.shape[1], torch.float32, hidden.device, causal=causal)
    output, _ = attention(block.layer.input_layernorm(hidden), rotary, mask, gate_rows=gate_rows)
    return hidden + families.attention_added(block.layer, output)


def block_parameters(block: StudentBlock, fit_gate: bool) -> list[torch.nn.Parameter]:
    """What a layer's fit moves: its attention block, with its gate table and W^{UE} when the gate is fitted."""
    attention = block.layer.self_attn
    gate = {
        id(p) for module in (attention.gate_embedding_proj, attention.gate_norm) if module for p in module.parameters()
    }
    parameters = [p for p in attention.parameters() if fit_gate or id(p) not in gate]
    if fit_gate and block.table is not None and block.moves_table:
        parameters += list(block.table.parameters())
    return parameters


def block_error(output: torch.Tensor, streams: LayerStreams, rows=slice(None)) -> torch.Tensor:
    """|output - target|^2 / |target - input|^2: the block's error relative to what the source's block adds."""
    target = streams.target[rows]
    return (output - target).pow(2).sum() / (target - streams.reference_in[rows]).pow(2).sum().clamp(min=1e-30)


# The longest fitted block attended eagerly on a CPU: eager attention holds a step's [B, H, S, S] scores.
EAGER_FIT_MAX_LENGTH = 1024


@contextlib.contextmanager
def fitting_attention(config, device: torch.device, length: int):
    """The student's attention implementation while a layer is fitted on blocks of `length` tokens: eager on a CPU
    for blocks up to EAGER_FIT_MAX_LENGTH, where SDPA's fused kernel is slower (docs/results.md#behind-the-defaults), the model's own
    elsewhere. The
    model keeps its implementation afterwards."""
    if device.type != "cpu" or length > EAGER_FIT_MAX_LENGTH:
        yield
        return
    kept = config._attn_implementation
    config._attn_implementation = "eager"
    try:
        yield
    finally:
        config._attn_implementation = kept


def layer_autocast(block: StudentBlock, settings: ReconstructionSettings, device: torch.device) -> torch.autocast:
    """The autocast of a layer's fit: its steps and its passes over all the calibration blocks (the source's layer,
    the student's before and after, the stream into the next layer) run under it; the errors are summed in fp32.
    Entered anew for each pass: within one autocast region, the bf16 copies of the weights are cast once and kept,
    so a step's update would not reach the next step's forward."""
    return fitting_autocast(settings.mixed_precision, device, block.layer.self_attn.config.hidden_size)


class LayerFit(NamedTuple):
    """One layer's fit: its report row and the student's stream after the kept block's attention [N, S, D]."""

    row: dict
    attended: torch.Tensor


def fit_layer(block: StudentBlock, streams: LayerStreams, blocks, rotary, settings: ReconstructionSettings) -> LayerFit:
    """Adam with cosine decay on one block; its error on all calibration blocks before and after."""
    layer_idx, parameters = block.layer.self_attn.layer_idx, block_parameters(block, settings.fit_gate)
    start = [parameter.detach().clone() for parameter in parameters]
    device = streams.student_in.device

    def attended_and_error() -> tuple[torch.Tensor, float]:
        attended = block_output(block, streams.student_in, blocks, rotary, settings)
        return attended, block_error(attended.float(), streams).item()

    closed_form, before = attended_and_error()
    # Eager for the steps only: over all N blocks at once, eager would hold [N, H, S, S] scores.
    with fitting_attention(block.layer.self_attn.config, device, blocks.shape[1]):
        adam_steps(block, parameters, streams, blocks, rotary, settings)
    attended, after = attended_and_error()
    if after >= before:  # keep the closed-form block
        with torch.no_grad():
            for parameter, value in zip(parameters, start, strict=True):
                parameter.copy_(value)
        attended = closed_form
    row = {"layer": layer_idx, "before": before, "after": min(before, after), "fitted": after < before}
    return LayerFit(row, attended)


@torch.no_grad()
def block_output(block: StudentBlock, student_in, blocks, rotary, settings: ReconstructionSettings) -> torch.Tensor:
    """The student's stream after the block's attention, over all the calibration blocks [N, S, D]."""
    with layer_autocast(block, settings, student_in.device):
        return student_attention(block, student_in, blocks, rotary)


def weight_scale(attention: torch.nn.Module) -> float:
    """The RMS of a student attention's query and output projection weights (the source's, the query's rows mapped
    to the student's head): the size that the layer-wise fit's learning rate is relative to."""
    names = ("q_proj", "q_a_proj", "q_b_proj", "o_proj")
    weights = [module.weight.detach().float() for name in names if (module := getattr(attention, name, None))]
    return math.sqrt(sum(weight.pow(2).sum().item() for weight in weights) / sum(w.numel() for w in weights))


def adam_steps(
    block: StudentBlock, parameters: list, streams: LayerStreams, blocks, rotary, settings: ReconstructionSettings
) -> None:
    """`settings.steps` Adam steps with cosine decay on `parameters` (`block_parameters`), a few random blocks a
    step, at the learning rate relative to the layer's `weight_scale`."""
    device = streams.student_in.device
    optimizer = torch.optim.Adam(parameters, lr=settings.learning_rate * weight_scale(block.layer.self_attn))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / settings.steps))
    )
    generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + block.layer.self_attn.layer_idx)
    for parameter in parameters:
        parameter.requires_grad_(True)
    for _ in range(settings.steps):
        rows = torch.randint(0, len(blocks), (settings.batch_size,), generator=generator)
        with layer_autocast(block, settings, device):
            output = student_attention(block, streams.student_in[rows], blocks[rows], rotary)
        loss = block_error(output.float(), streams, rows)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    optimizer.zero_grad(set_to_none=True)  # no stale gradient reaches a later stage's first step
    for parameter in parameters:
        parameter.requires_grad_(False)


@torch.no_grad()
def next_student_stream(block: StudentBlock, attended: torch.Tensor) -> torch.Tensor:
    """The student's residual stream after the block's layer, from its stream after the attention (`LayerFit`)."""
    return block.layer.mlp_block(attended)


@dataclass
class FittingStreams:
    """The layer-wise fit's data, on the host: the calibration blocks packed to the recovery length [M, L] and the
    source's and the student's residual streams entering the next layer [M, L, D]."""

    blocks: torch.Tensor
    source: torch.Tensor
    student: torch.Tensor
    settings: ReconstructionSettings  # its batch size counts packed blocks


def fit_and_advance(block: StudentBlock, source_layer, fitting: FittingStreams, source_rotary, student_rotary) -> dict:
    """Fits the student's `block` to `source_layer` (a source decoder layer) on the streams entering them, moves
    both streams past the layer, and returns the fit's report row."""
    device = source_layer.input_layernorm.weight.device
    blocks, source_in, student_in = (tensor.to(device) for tensor in (fitting.blocks, fitting.source, fitting.student))
    positions = torch.arange(blocks.shape[1], device=device)[None]
    with layer_autocast(block, fitting.settings, device), torch.no_grad():  # the source's streams are targets
        rotary = source_rotary(source_in, positions)
        reference, source_out = source_layer_pass(source_layer, source_in, rotary)
        if fitting.settings.fits_the_block(source_layer):
            reference = source_attention(source_layer, student_in, rotary)
        reference_in = reference.hidden
        target = reference_in + families.attention_added(source_layer, reference.attention)
    streams = LayerStreams(student_in, reference_in, target)
    row, attended = fit_layer(block, streams, blocks, student_rotary(student_in, positions), fitting.settings)
    with layer_autocast(block, fitting.settings, device):
        fitting.student = next_student_stream(block, attended).cpu()
    fitting.source = source_out.cpu()
    return row


def reconstruct_layers(
    student: EGMLAForCausalLM, source: LlamaForCausalLM, blocks: torch.Tensor, settings: ReconstructionSettings
) -> list[dict]:
    """Fits every attention block of an already built `student` in place, first layer to last, on calibration token
    blocks [N, S] (see the module docstring), as the conversion's layer pass fits each layer as it goes by; per
    layer, the block error before and after. The caller's random state is left as it was."""
    if settings.steps == 0:
        return []
    student.eval().requires_grad_(False)
    with torch.no_grad():
        hidden = source.model.embed_tokens(blocks).cpu()
    fitting = FittingStreams(blocks.cpu(), hidden, hidden.clone(), settings)
    rows = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        for layer_idx in tqdm(range(student.config.num_hidden_layers), desc="fitting layers", unit="layer"):
            source_rotary = families.layer_rotary(source.model.rotary_emb, source.config, layer_idx)
            student_rotary = student.model.rotary_of(layer_idx)
            block = student_block(student, layer_idx)
            rows.append(fit_and_advance(block, source.model.layers[layer_idx], fitting, source_rotary, student_rotary))
    student.requires_grad_(True)
    return rows
