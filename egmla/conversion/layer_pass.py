"""The conversion's one pass over the source's layers, whatever holds them (`LayerSource`: a model in memory, or a
checkpoint's safetensors files read a layer at a time). The split search's pass first, where the split is left to
it (`search.py`); then, layer by layer: calibrate (or read the statistics the search saved), split and factorize,
build the student layer, fit its gate (the gate on K/V, by least squares) and then its attention block (the
layer-wise fit), move the held-out documents past it, and hand the layer to a sink: `HeldLayers` keeps it for the
whole model built after the pass (`pipeline.py`), `LayerShards` writes it as a shard (`streaming.py`). After each
layer the pass saves what a killed run continues from."""

import dataclasses
from contextlib import nullcontext
from pathlib import Path
from typing import ClassVar, NamedTuple, Protocol

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..modeling_egmla import EGMLAAttention, EGMLAGateTable
from ..options import Placement
from ..outputs import replace_atomically
from ..precision import uses_bf16
from . import families
from .calibration import LayerStatistics, source_attention
from .convert import ConversionOptions, ConversionPlan, LayerPlan, factorize_layer, resolve_budget
from .factorization import allocate_ranks
from .fitting_text import TextSettings, layer_wise_inputs
from .gate import GateFit, gate_fit, gate_layer, set_table
from .layer_source import LayerSource, convert_layer, layer_config, run_layer, student_layer
from .reconstruction import FittingStreams, ReconstructionSettings, StudentBlock, fit_and_advance
from .scoring import DocumentStreams, advance_documents, document_streams
from .search import candidates, choose_split
from .timing import StageTimes
from .work import WorkFolder


class ConversionJob(Protocol):
    """What the pass reads of a conversion's job (`pipeline.ConversionJob`)."""

    options: ConversionOptions
    reconstruction: ReconstructionSettings
    placement: Placement
    text: TextSettings


class PassText(NamedTuple):
    """What the pass reads beside the source."""

    blocks: torch.Tensor  # calibration token blocks [N, S]
    fit_length: int  # tokens per packed block of the layer-wise fit
    documents: tuple[torch.Tensor, ...] = ()  # held-out documents scored as the layers go by (none: scored after)
    extra: tuple[tuple[str, list[torch.Tensor]], ...] = ()  # more held-out texts' documents: (name, documents)


class LayerSink(Protocol):
    """Where each converted layer goes: its student tensors in closed form (the gate fitted) and after the fit."""

    def write(self, layer_idx: int, closed_form: dict, fitted: dict) -> None: ...
    def progress(self) -> dict: ...
    def restore(self, progress: dict, layers: int) -> None: ...


class HeldStatistics(dict):
    """The split search's statistics kept in memory, where the job keeps no work folder (as `WorkFolder` keeps
    them on disk)."""

    def save_statistics(self, layer_idx: int, statistics: LayerStatistics) -> None:
        self[layer_idx] = statistics

    def load_statistics(self, layer_idx: int) -> LayerStatistics:
        return self[layer_idx]


@dataclasses.dataclass
class LayerPass:
    """The pass's state beside its plan (a layer added as each goes by) and its sink: the per-layer ranks, the gate's
    and the layer-wise fit's rows, the held-out documents' streams (None: not scored), and the streams entering the
    next layer: the calibration blocks' (where the statistics are not saved, or the gate reads them) and the
    layer-wise fit's. `progress` and `restore` carry them across a killed run."""

    plan: ConversionPlan
    sink: LayerSink
    ranks: list[int]
    gate: GateFit | None = None
    rows: list = dataclasses.field(default_factory=list)
    gate_rows: list = dataclasses.field(default_factory=list)
    documents: DocumentStreams | None = None
    extra: dict[str, DocumentStreams] = dataclasses.field(default_factory=dict)
    hidden: torch.Tensor | None = None
    fitting: FittingStreams | None = None
    CARRIED: ClassVar[tuple[str, ...]] = ("rows", "gate_rows", "hidden")

    def progress(self) -> dict:
        """Tensors, lists and numbers only (`torch.load(weights_only=True)` reads them back)."""
        return {
            **{name: getattr(self, name) for name in self.CARRIED},
            "frequencies": [layer.frequencies for layer in self.plan.layers],
            "fitting": both_streams(self.fitting),
            "documents": both_streams(self.documents),
            "extra": {name: both_streams(streams) for name, streams in self.extra.items()},
            "sink": self.sink.progress(),
        }

    def restore(self, progress: dict) -> None:
        for name in self.CARRIED:
            setattr(self, name, progress[name])
        frequencies = progress["frequencies"]  # the layers a killed run finished are in the plan again
        self.plan.layers[:] = [LayerPlan(turns, rank) for turns, rank in zip(frequencies, self.ranks, strict=False)]
        saved = [(self.fitting, progress["fitting"]), (self.documents, progress["documents"])]
        saved += [(streams, progress["extra"][name]) for name, streams in self.extra.items()]
        for streams, pair in saved:
            if streams is not None:
                streams.source, streams.student = pair
        self.sink.restore(progress["sink"], len(frequencies))


def both_streams(streams: FittingStreams | DocumentStreams | None) -> list | None:
    return None if streams is None else [streams.source, streams.student]


def fitting_streams(blocks: torch.Tensor, embeddings: torch.Tensor, job: ConversionJob, length: int):
    """The layer-wise fit's streams over the calibration blocks packed to `length`; None when the fit is off."""
    if job.reconstruction.steps == 0:
        return None
    packed, settings = layer_wise_inputs(blocks, length, job.reconstruction)
    hidden = torch.nn.functional.embedding(packed, embeddings).to(job.placement.torch_dtype)
    return FittingStreams(packed, hidden, hidden.clone(), settings)


def fits_gate(job: ConversionJob) -> bool:
    """Whether each layer's gate on K/V is set by least squares before its layer-wise fit."""
    options = job.options
    gated = options.gate_embedding_dim > 0 and options.gate_position == "kv"
    return gated and job.reconstruction.gate_init == "least_squares"


def start_pass(source: LayerSource, job: ConversionJob, plan: ConversionPlan, text: PassText, setup: "PassSetup"):
    """The pass's state before its first layer."""
    sink, ranks, statistics = setup
    embeddings = source.embeddings()
    context, device = source.config.max_position_embeddings, job.placement.torch_device()
    bf16 = uses_bf16(job.text.scoring_mixed_precision, device, source.config.hidden_size)
    gate = gate_fit(text.blocks, job.reconstruction.gate_shrinkage) if fits_gate(job) else None
    calibrates = statistics is None or gate is not None
    return LayerPass(
        plan,
        sink,
        ranks,
        gate,
        documents=document_streams(text.documents, embeddings, context, bf16) if text.documents else None,
        extra={name: document_streams(ids, embeddings, context, bf16) for name, ids in text.extra if ids},
        hidden=torch.nn.functional.embedding(text.blocks, embeddings) if calibrates else None,
        fitting=fitting_streams(text.blocks, embeddings, job, text.fit_length),
    )


def calibrate_layer(layer, rotary, state: LayerPass, saved: LayerStatistics | None) -> tuple:
    """(the layer's statistics: `saved`, or recorded on the calibration stream; the source's inputs to the gate's
    fit, or None), the calibration stream moved past the layer."""
    gate_inputs = None
    if state.gate is not None:
        device = layer.input_layernorm.weight.device
        hidden = state.hidden.to(device)
        positions = torch.arange(hidden.shape[1], device=device)[None]
        gate_inputs = source_attention(layer, hidden, rotary(hidden, positions))
    statistics = saved
    if state.hidden is not None:
        recorded, state.hidden = run_layer(layer, state.hidden, rotary, record=saved is None)
        statistics = saved if saved is not None else recorded
    return statistics, gate_inputs


def initial_gate(config, layer_idx: int, seed: int) -> dict[str, torch.Tensor]:
    """A layer's fresh gate (none when it is off): its table random (drawn from `seed` and the layer, the caller's
    random state untouched) and W^{UE} zero, so that the gate starts as the identity."""
    if not config.gate_enabled:
        return {}
    with torch.device("meta"):
        projection = EGMLAAttention(config, layer_idx).gate_embedding_proj  # its shape only
    generator = torch.Generator().manual_seed(seed * 1_000_003 + layer_idx)
    return {
        f"model.gate_embeddings.{layer_idx}.weight": torch.randn(
            config.vocab_size, config.gate_embedding_dim, generator=generator
        ),
        f"model.layers.{layer_idx}.self_attn.gate_embedding_proj.weight": torch.zeros(projection.weight.shape),
    }


def student_table(state: dict, layer_idx: int, like: torch.Tensor) -> EGMLAGateTable | None:
    """The layer's gate table built from its `state` (None when the gate is off)."""
    weight = state.get(f"model.gate_embeddings.{layer_idx}.weight")
    if weight is None:
        return None
    table = EGMLAGateTable(*weight.shape)
    table.weight.data = weight.detach().clone()
    return table.to(device=like.device, dtype=like.dtype).requires_grad_(False)


def layer_state(student, table, layer_idx: int, copied: bool) -> dict[str, torch.Tensor]:
    """The student layer's tensors (and its gate table's); `copied` where the layer-wise fit will still move them in
    place (after the fit nothing does, and the layer is let go)."""
    state = {f"model.layers.{layer_idx}.{name}": tensor for name, tensor in student.state_dict().items()}
    if table is not None:
        state[f"model.gate_embeddings.{layer_idx}.weight"] = table.weight.detach()
    return {name: tensor.clone() for name, tensor in state.items()} if copied else state


def pass_layer(source: LayerSource, layer_idx: int, state: LayerPass, saved, times: StageTimes) -> None:
    """One layer of the pass (see the module docstring), handed to the sink."""
    layer = source.layer(layer_idx)
    rotary, plan, like = source.rotary(layer), state.plan, layer.input_layernorm.weight
    with times.stage("calibration"):
        statistics, gate_inputs = calibrate_layer(layer, rotary, state, saved)
    with times.stage("factorization"):
        closed_form, planned = convert_layer(source.model, layer, layer_idx, statistics, plan, state.ranks[layer_idx])
    config = layer_config(source.model, plan)
    closed_form |= initial_gate(config, layer_idx, plan.options.seed)
    student, student_rotary = student_layer(closed_form, layer_idx, config, like)
    table = student_table(closed_form, layer_idx, like)
    if gate_inputs is not None:
        with times.stage("gate fit"):
            fitted_gate = gate_layer(student.self_attn, layer.self_attn, planned.split, gate_inputs, state.gate)
            state.gate_rows.append(set_table(table, [fitted_gate], student_rotary, state.gate))
            del gate_inputs, fitted_gate  # [N, S, D] each, on the device: freed before the fit
        closed_form = layer_state(student, table, layer_idx, copied=state.fitting is not None)
    fitted = closed_form
    if state.fitting is not None:
        with times.stage("layer-wise fit"):
            block = StudentBlock(student, table, moves_table=True)
            state.rows.append(fit_and_advance(block, layer, state.fitting, rotary, student_rotary))
        fitted = layer_state(student, table, layer_idx, copied=False)
    if state.documents is not None:
        with times.stage("scoring"):
            for documents in [state.documents, *state.extra.values()]:
                advance_documents(documents, layer, rotary, student, student_rotary, table)
    state.sink.write(layer_idx, closed_form, fitted)


def check_options(config, options) -> None:
    """The options' errors on this source (a budget out of range, no room left for a rope key), raised before any
    work starts."""
    for choice in candidates(config, options):
        resolve_budget(config, choice)


class PassSetup(NamedTuple):
    sink: LayerSink
    ranks: list[int]  # each layer's latent width
    statistics: WorkFolder | HeldStatistics | None  # where each layer's statistics were saved (None: calibrated here)


def pass_layers(source: LayerSource, job: ConversionJob, plan: ConversionPlan, text: PassText, setup: PassSetup,
                work: WorkFolder | None, times: StageTimes) -> LayerPass:  # fmt: skip
    """Every layer converted, fitted and handed to the sink, its plan added to `plan`; a killed run's pass continues
    after its last finished layer."""
    state = start_pass(source, job, plan, text, setup)
    if work is not None and (progress := work.saved_progress()) is not None:
        state.restore(progress)
    layers = range(len(plan.layers), source.config.num_hidden_layers)
    for layer_idx in tqdm(layers, desc="converting layers", unit="layer", leave=False):
        saved = setup.statistics.load_statistics(layer_idx) if setup.statistics is not None else None
        pass_layer(source, layer_idx, state, saved, times)
        if work is not None:
            work.save_progress(state.progress())  # after the sink's write: a saved layer is always a written one
    state.hidden = state.fitting = None  # what entered the next layer: no layer is left
    return state


def statistics_pass(source: LayerSource, blocks: torch.Tensor, keep) -> None:
    """Every layer's statistics on the calibration blocks, given to `keep(layer_idx, statistics)`."""
    hidden = torch.nn.functional.embedding(blocks, source.embeddings())
    for layer_idx in tqdm(range(source.config.num_hidden_layers), desc="calibrating", unit="layer", leave=False):
        layer = source.layer(layer_idx)
        statistics, hidden = run_layer(layer, hidden, source.rotary(layer))
        keep(layer_idx, statistics)


def layer_ranks(source: LayerSource, plan: ConversionPlan, blocks: torch.Tensor, store, saved: bool, times) -> list:
    """Each layer's latent width: the budget's, or with `rank_allocation="energy"` the same total given where the
    spectra of all layers hold the most energy (their statistics taken first into `store` unless `saved` there;
    one layer factorized at a time, its spectrum's energy kept)."""
    layers, rank = source.config.num_hidden_layers, plan.budget.kv_lora_rank
    if plan.options.rank_allocation == "uniform":
        return [rank] * layers
    if not saved:
        with times.stage("calibration"):
            statistics_pass(source, blocks, store.save_statistics)
    energies = []
    for layer_idx in tqdm(range(layers), desc="ranking layers", unit="layer", leave=False):
        inv_freq = families.inv_freq(source.model.model.rotary_emb, source.config, layer_idx)
        with times.stage("factorization"):
            statistics = store.load_statistics(layer_idx)
            attention = source.layer(layer_idx).self_attn
            energies.append(factorize_layer(attention, statistics, inv_freq, plan.budget, plan.options)[1].energy())
    return allocate_ranks(energies, rank, "energy")


def run_pass(source: LayerSource, job: ConversionJob, text: PassText, sink: LayerSink, work: WorkFolder | None,
             times: StageTimes) -> LayerPass:  # fmt: skip
    """The split search's pass where the split is left to it (unless a killed run finished it), then the layers';
    the `LayerPass` it leaves holds the plan, its layers added as they went by, and the search's table."""
    store = work if work is not None else HeldStatistics()
    if work is not None:
        work.statistics.mkdir(parents=True, exist_ok=True)
        work.shards.mkdir(parents=True, exist_ok=True)
    searched = work.saved_search() if work is not None else None
    if searched is None:
        with times.stage("split search") if job.options.rope_split == "auto" else nullcontext():
            searched = choose_split(source, job.options, text.blocks, store.save_statistics)
        if work is not None:
            work.save_search(*searched)
    options, candidates = searched
    plan = ConversionPlan(options, resolve_budget(source.config, options), [], candidates)
    saved = bool(candidates)  # the search's pass saved every layer's statistics
    ranks = work.saved_ranks() if work is not None else None  # a killed run's, as they were
    if ranks is None:
        ranks = layer_ranks(source, plan, text.blocks, store, saved, times)
        if work is not None:
            work.save_ranks(ranks)
    saved = saved or options.rank_allocation == "energy"  # ranking by energy saved them too
    return pass_layers(source, job, plan, text, PassSetup(sink, ranks, store if saved else None), work, times)


class HeldLayers:
    """The whole-model conversion's sink: each layer's converted attention (and gate table), in closed form and
    fitted, kept for the student built after the pass; with a work folder, also written there for a resumed run."""

    def __init__(self, folder: Path | None, dtype: torch.dtype):
        self.folder, self.dtype, self.closed_form, self.fitted = folder, dtype, {}, {}

    def converted(self, state: dict) -> dict[str, torch.Tensor]:
        """What conversion changed of a layer (its attention, its gate table), in the student's dtype: the rest is
        the source's own."""
        changed = {
            name: tensor for name, tensor in state.items() if ".self_attn." in name or ".gate_embeddings." in name
        }
        return {name: tensor.to("cpu", self.dtype) for name, tensor in changed.items()}

    def write(self, layer_idx: int, closed_form: dict, fitted: dict) -> None:
        unfitted = fitted is closed_form
        closed_form = self.converted(closed_form)
        fitted = closed_form if unfitted else self.converted(fitted)
        self.closed_form.update(closed_form)
        self.fitted.update(fitted)
        if self.folder is not None:  # an unfitted layer's tensors once
            tensors = {f"closed_form.{name}": value.contiguous() for name, value in closed_form.items()}
            if not unfitted:
                tensors |= {f"fitted.{name}": value.contiguous() for name, value in fitted.items()}
            replace_atomically(self.path(layer_idx), lambda path: save_file(tensors, path))

    def path(self, layer_idx: int) -> Path:
        return self.folder / f"layer-{layer_idx:05d}.safetensors"

    def progress(self) -> dict:
        return {}

    def restore(self, progress: dict, layers: int) -> None:
        for layer_idx in range(layers):
            saved = {tuple(name.split(".", 1)): value for name, value in load_file(self.path(layer_idx)).items()}
            closed_form = {name: value for (kind, name), value in saved.items() if kind == "closed_form"}
            self.closed_form.update(closed_form)
            self.fitted.update({name: saved.get(("fitted", name), value) for name, value in closed_form.items()})
