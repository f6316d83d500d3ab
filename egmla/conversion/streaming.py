"""Streaming conversion (`egmla convert --stream`): the source is read one decoder layer at a time from its
safetensors files (`safe_open`), calibrated on the hidden states the layer before it produced (kept on the host in
the chosen dtype), factorized, fitted by the layer-wise fit (as the whole-model conversion fits it, on the source's
and the student's streams, also kept on the host), and its student layer written as a shard of its own; peak memory
is one source layer and one student layer, the embeddings and the activations, not two whole models. With the split
left to the search, a first pass streams the layers for it (`search.py`, the whole-model conversion's search) and the conversion reads the
statistics it saved. The held-out documents move through each source layer and its student layer as they go by
(`scoring.py`, which scores the whole-model conversion's too). The gate and the recovery need the whole model: streaming does without them."""

import dataclasses
import json
import os
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import ClassVar, NamedTuple

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import GenerationConfig
from transformers.dynamic_module_utils import custom_object_save

from ..hub import public_name
from ..modeling_egmla import EGMLAForCausalLM
from ..outputs import atomic_folder, check_output_folder
from ..precision import uses_bf16
from ..text import document_ids, token_blocks
from .calibration import source_layer_pass
from .convert import ConversionOptions, ConversionPlan, LayerPlan, resolve_budget
from .fitting_text import (
    extra_documents,
    fitting_and_held_out,
    layer_wise_inputs,
    recovery_length,
    split_train_text,
)
from .layer_source import (
    ShardedLayers,
    convert_layer,
    layer_config,
    run_layer,
    student_layer,
)
from .reconstruction import (
    LayerStreams,
    ReconstructionSettings,
    StudentBlock,
    fit_layer,
    layer_autocast,
    next_student_stream,
)
from .report import ConversionReport, job_card, print_report, write_model_card
from .scoring import DocumentStreams, advance_documents, document_streams, score_streams
from .search import choose_split
from .source import check_tokenizer, load_tokenizer, source_config
from .timing import StageTimes
from .work import StreamWork, start_work


def check_streamable(options: ConversionOptions) -> None:
    """Refuses by name what streaming cannot convert: per-layer ranks by energy need every layer's spectrum at once,
    and the gate's tables span layers."""
    if options.rank_allocation != "uniform":
        raise ValueError("--stream allocates ranks uniformly: rank_allocation='energy' needs every layer at once.")
    if options.gate_embedding_dim > 0:
        raise ValueError("--stream converts without the gate (gate_embedding_dim=0): its tables span layers.")


def write_shard(staging: Path, name: str, state: dict, dtype: torch.dtype, weight_map: dict) -> int:
    save_file({key: value.to(dtype).contiguous().cpu() for key, value in state.items()}, staging / name)
    weight_map.update(dict.fromkeys(state, name))
    return sum(value.numel() * dtype.itemsize for value in state.values())


def calibration_blocks(job, tokenizer) -> torch.Tensor:
    """The calibration token blocks [N, S] cut from the fitting text (its held-out documents left out, as in the
    whole-model conversion)."""
    if job.text.train_text is None:
        raise ValueError("--stream calibrates on text: give --train-text FILE (sampling text needs the whole model).")
    documents, _ = split_train_text(job.text)
    blocks = token_blocks(tokenizer, documents, job.text.block_size, source=f"--train-text {job.text.train_text}")
    return blocks[: job.text.calibration_blocks]


@dataclasses.dataclass
class FittingStreams:
    """The layer-wise fit's data, on the host: the calibration blocks packed to the recovery length [M, L] and the
    source's and the student's residual streams entering the next layer [M, L, D]."""

    blocks: torch.Tensor
    source: torch.Tensor
    student: torch.Tensor
    settings: ReconstructionSettings  # its batch size counts packed blocks


def fitting_streams(blocks: torch.Tensor, embeddings: torch.Tensor, job, context: int) -> FittingStreams | None:
    """None when the layer-wise fit is off (`--reconstruction-steps 0`)."""
    if job.reconstruction.steps == 0:
        return None
    packed, settings = layer_wise_inputs(blocks, recovery_length(job.text, context), job.reconstruction)
    hidden = torch.nn.functional.embedding(packed, embeddings).to(job.placement.torch_dtype)
    return FittingStreams(packed, hidden, hidden.clone(), settings)


def fit_streamed_layer(source, layer_idx: int, state: dict, config, fitting: FittingStreams, source_rotary):
    """Student layer `layer_idx`, built from its closed-form `state`, fitted to the `source` layer as the whole-model
    conversion fits it; both streams advance past the layer. Returns its fitted state and its report row."""
    prefix = f"model.layers.{layer_idx}."
    student, student_rotary = student_layer(state, layer_idx, config, source.input_layernorm.weight)
    device = source.input_layernorm.weight.device
    blocks, source_in, student_in = (tensor.to(device) for tensor in (fitting.blocks, fitting.source, fitting.student))
    positions = torch.arange(blocks.shape[1], device=device)[None]
    rotary = student_rotary(student_in, positions)
    block = StudentBlock(student, None, False)
    with layer_autocast(block, fitting.settings, device):
        layer, source_out = source_layer_pass(source, source_in, source_rotary(source_in, positions))
    streams = LayerStreams(student_in, layer.hidden, layer.hidden + layer.attention)
    row, attended = fit_layer(block, streams, blocks, rotary, fitting.settings)
    with layer_autocast(block, fitting.settings, device):
        fitting.student = next_student_stream(block, attended).cpu()
    fitting.source = source_out.cpu()
    return {prefix + name: tensor for name, tensor in student.state_dict().items()}, row


class StreamedText(NamedTuple):
    """What the conversion's pass reads beside the source: the calibration blocks and the held-out documents."""

    blocks: torch.Tensor  # calibration token blocks [N, S]
    documents: list[torch.Tensor]  # held-out documents' ids, whole up to the source's context (none: not scored)
    extra: dict[str, list[torch.Tensor]]  # more held-out texts' documents, by name


@dataclasses.dataclass
class LayersWritten:
    """What the conversion's pass over the layers leaves beside its plan (a layer added as each is written): the
    shards' weight map and bytes, the layer-wise fit's rows, and the held-out documents' streams past the last layer
    (None: not scored). While it runs, also the streams entering the next layer: the calibration blocks' (where no
    statistics were saved) and the layer-wise fit's; `progress` and `restore` carry them and the plan's layers
    across a killed run."""

    plan: ConversionPlan
    weight_map: dict = dataclasses.field(default_factory=dict)
    total: int = 0
    rows: list = dataclasses.field(default_factory=list)
    documents: DocumentStreams | None = None
    extra: dict[str, DocumentStreams] = dataclasses.field(default_factory=dict)
    hidden: torch.Tensor | None = None
    fitting: FittingStreams | None = None
    # What a killed run's pass takes back as it was, beside the plan's layers and the streams (`both_streams`).
    CARRIED: ClassVar[tuple[str, ...]] = ("weight_map", "total", "rows", "hidden")

    def progress(self) -> dict:
        """Tensors, lists and numbers only (`torch.load(weights_only=True)` reads them back)."""
        return {
            **{name: getattr(self, name) for name in self.CARRIED},
            "frequencies": [layer.frequencies for layer in self.plan.layers],
            "fitting": both_streams(self.fitting),
            "documents": both_streams(self.documents),
            "extra": {name: both_streams(streams) for name, streams in self.extra.items()},
        }

    def restore(self, progress: dict) -> None:
        for name in self.CARRIED:
            setattr(self, name, progress[name])
        rank = self.plan.budget.kv_lora_rank  # the layers a killed run finished are in the plan again
        self.plan.layers[:] = [LayerPlan(frequencies, rank) for frequencies in progress["frequencies"]]
        saved = [(self.fitting, progress["fitting"]), (self.documents, progress["documents"])]
        saved += [(streams, progress["extra"][name]) for name, streams in self.extra.items()]
        for streams, pair in saved:
            if streams is not None:
                streams.source, streams.student = pair


def both_streams(streams: FittingStreams | DocumentStreams | None) -> list | None:
    return None if streams is None else [streams.source, streams.student]


def layer_by_layer(source: ShardedLayers, job, plan: ConversionPlan, work: StreamWork, text, searched: bool):
    """Every layer read, calibrated on `text.blocks` (or, where the split search ran, its statistics read back from
    `work`), factorized, fitted and written to `work`, the held-out documents moved past it: a `LayersWritten`. A
    killed run's pass continues after its last finished layer."""
    placement, source_model = job.placement, source.model
    context = source_model.config.max_position_embeddings
    embeddings = source.embeddings()
    bf16 = uses_bf16(job.text.scoring_mixed_precision, placement.torch_device(), source_model.config.hidden_size)
    written = LayersWritten(
        plan,
        documents=document_streams(text.documents, embeddings, context, bf16) if text.documents else None,
        extra={name: document_streams(ids, embeddings, context, bf16) for name, ids in text.extra.items() if ids},
        hidden=None if searched else torch.nn.functional.embedding(text.blocks, embeddings),
        fitting=fitting_streams(text.blocks, embeddings, job, context),
    )
    if (progress := work.saved_progress()) is not None:
        written.restore(progress)
    layers = range(len(plan.layers), source_model.config.num_hidden_layers)
    for layer_idx in tqdm(layers, desc="streaming layers", unit="layer", leave=False):
        layer = source.layer(layer_idx)
        rotary = source.rotary(layer)
        if searched:
            statistics = work.load_statistics(layer_idx)
        else:
            statistics, written.hidden = run_layer(layer, written.hidden, rotary)
        state = convert_layer(source_model, layer, layer_idx, statistics, plan)
        config = layer_config(source_model, plan)
        if written.fitting is not None:
            state, row = fit_streamed_layer(layer, layer_idx, state, config, written.fitting, rotary)
            written.rows.append(row)
        streams = [written.documents, *written.extra.values()] if written.documents is not None else []
        if streams:
            student, student_rotary = student_layer(state, layer_idx, config, layer.input_layernorm.weight)
            for documents in streams:
                advance_documents(documents, layer, rotary, student, student_rotary)
        name = f"model-layer-{layer_idx:05d}.safetensors"
        written.total += write_shard(work.shards, name, state, placement.torch_dtype, written.weight_map)
        work.save_progress(written.progress())  # after the shard: a saved layer is always a written one
        del layer, state  # one layer at a time
    return written


def held_out_documents(job, tokenizer, context: int) -> tuple[list[torch.Tensor], str, dict]:
    """The held-out documents the whole-model conversion scores (none with `eval_documents=0`), where from, and the
    documents of every extra held-out text by name."""
    _, documents, eval_source = fitting_and_held_out(job.text)
    held_out = document_ids(tokenizer, documents[: job.text.eval_documents], context)
    return held_out, eval_source, extra_documents(tokenizer, job.text, context)


def run_streaming_conversion(job) -> ConversionReport:
    """Converts `job.source` (a local folder of safetensors) layer by layer into `job.out`: the split search's pass
    where the split is left to it, then the conversion's (the closed form, and the layer-wise fit unless it is off),
    scoring the held-out documents as it goes."""
    folder = Path(job.source)
    if not folder.is_dir():
        raise ValueError(f"--stream reads a local folder of safetensors files; {job.source} is not one.")
    check_output_folder(job.out, job.overwrite, (str(folder),))
    started, times = time.time(), StageTimes()
    config = source_config(folder)
    check_streamable(job.options)
    source, tokenizer = ShardedLayers(folder, config, job.placement), load_tokenizer(str(folder))
    check_tokenizer(tokenizer, config, folder)
    blocks = calibration_blocks(job, tokenizer)  # refuses a job without text by name
    documents, eval_source, extra = held_out_documents(job, tokenizer, config.max_position_embeddings)
    text = StreamedText(blocks, documents, extra)
    work = StreamWork(start_work(dataclasses.replace(job, stream=True)))  # a killed run resumes from here
    with atomic_folder(job.out, job.overwrite, (str(folder),)) as staging:
        plan, candidates, written = convert_layers(source, job, work, text, times)
        report = streamed_report(job, plan, candidates, written)
        outer = write_outside_layers(source, staging, work, written, times)
        if written.documents is not None:
            report.saved_stage = "layer-wise" if written.rows else "zero-shot"
            report.text = {"eval_text": eval_source, "eval_documents": len(documents),
                           "scoring_autocast": "bf16" if written.documents.bf16 else None}  # fmt: skip
            with times.stage("scoring"):
                norm_and_head = source.norm_and_head(outer)
                report.scores = score_streams(written.documents, written.extra, norm_and_head, report.saved_stage)
        student_config = layer_config(source.model, plan)
        save_config(student_config, staging, written.weight_map, written.total, job.placement.dtype)
        tokenizer.save_pretrained(staging)
        report.seconds, report.stage_seconds = round(time.time() - started, 1), times.seconds
        write_model_card(staging, report)
    shutil.rmtree(work.folder, ignore_errors=True)  # saved: nothing left to resume
    print_report(report)
    form = f"{len(written.rows)} layers fitted" if written.rows else "closed form"
    print(f"\nstreamed {config.num_hidden_layers} layers into {job.out} ({report.seconds} s, {form})")
    return report


def streamed_report(job, plan: ConversionPlan, candidates: list, written: "LayersWritten") -> ConversionReport:
    """The report's settings and the layer-wise fit's rows; the scores follow."""
    return ConversionReport(
        source=public_name(job.source),
        options=dataclasses.asdict(plan.options),
        budget=dataclasses.asdict(plan.budget),
        reconstruction={**dataclasses.asdict(job.reconstruction), "layers": written.rows},
        placement={"device": str(job.placement.torch_device()), "dtype": job.placement.dtype},
        candidates=candidates,
        card=job_card(job),
        streamed=True,
    )


def write_outside_layers(source: ShardedLayers, staging: Path, work: StreamWork, written, times: StageTimes) -> dict:
    """Every layer's shard linked into the output, and the tensors outside the layers written beside them (returned:
    the final norm and head score the streams)."""
    for name in sorted(set(written.weight_map.values())):
        link_or_copy(work.shards / name, staging / name)  # kept in `work` until the output is saved
    with times.stage("embeddings and head"):
        outer = source.outer()
        dtype = source.placement.torch_dtype
        written.total += write_shard(staging, "model-outer.safetensors", outer, dtype, written.weight_map)
    return outer


def convert_layers(source: ShardedLayers, job, work: StreamWork, text: StreamedText, times: StageTimes) -> tuple:
    """The split search's pass where the split is left to it (unless a killed run finished it), then the
    conversion's: (the plan, its layers added as they are written; the search's rows; the `LayersWritten`)."""
    work.statistics.mkdir(parents=True, exist_ok=True)
    work.shards.mkdir(parents=True, exist_ok=True)
    searched = work.saved_search()
    if searched is None:
        with times.stage("split search") if job.options.rope_split == "auto" else nullcontext():
            searched = choose_split(source, job.options, text.blocks, work.save_statistics)
        work.save_search(*searched)
    options, candidates = searched
    plan = ConversionPlan(options, resolve_budget(source.config, options))  # its layers come one by one
    with times.stage("layers"):
        written = layer_by_layer(source, job, plan, work, text, searched=bool(candidates))
    return plan, candidates, written


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link where the file system allows one (no second copy of a layer's weights), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def save_config(config, staging: Path, weight_map: dict, total: int, dtype: str) -> None:
    """config.json with the remote-code files and `auto_map`, the generation config and the shards' index."""
    config.dtype = dtype
    with torch.device("meta"):
        custom_object_save(EGMLAForCausalLM(config), staging, config=config)
    config.save_pretrained(staging)
    GenerationConfig.from_model_config(config).save_pretrained(staging)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
