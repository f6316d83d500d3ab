"""Streaming conversion (`egmla convert --stream`): the conversion's layer pass (`layer_pass.py`, as the
whole-model conversion runs it) over the source's safetensors files read a layer at a time (`ShardedLayers`), each
student layer written as a shard of its own (`LayerShards`); peak memory is one source layer and one student layer,
the embeddings and the activations, not two whole models. The held-out documents move through each source layer and
its student layer as they go by, and the final norm and head score them at the end. The recovery needs the whole
model: streaming does without it."""

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig
from transformers.dynamic_module_utils import custom_object_save

from ..hub import public_name
from ..modeling_egmla import EGMLAForCausalLM
from ..outputs import atomic_folder, check_output_folder, replace_atomically
from ..text import document_ids, token_blocks
from . import families
from .fitting_text import (
    extra_documents,
    fitting_and_held_out,
    recovery_length,
    split_train_text,
)
from .layer_pass import LayerPass, PassText, check_options, run_pass
from .layer_source import ShardedLayers, layer_config
from .report import ConversionReport, job_card, print_report, write_model_card
from .scoring import score_streams
from .source import check_tokenizer, load_tokenizer, source_config
from .timing import StageTimes
from .work import WorkFolder, start_work


def write_shard(staging: Path, name: str, state: dict, dtype: torch.dtype, weight_map: dict) -> int:
    tensors = {key: value.to(dtype).contiguous().cpu() for key, value in state.items()}
    replace_atomically(staging / name, lambda path: save_file(tensors, path))
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


class LayerShards:
    """The streamed conversion's sink: each layer's student tensors (as fitted) written to the work folder as a shard
    of its own, and the shards' weight map and bytes."""

    def __init__(self, work: WorkFolder, dtype: torch.dtype):
        self.work, self.dtype, self.weight_map, self.total = work, dtype, {}, 0

    def write(self, layer_idx: int, closed_form: dict, fitted: dict) -> None:
        name = f"model-layer-{layer_idx:05d}.safetensors"
        self.total += write_shard(self.work.shards, name, fitted, self.dtype, self.weight_map)

    def progress(self) -> dict:
        return {"weight_map": self.weight_map, "total": self.total}

    def restore(self, progress: dict, layers: int) -> None:
        self.weight_map, self.total = progress["weight_map"], progress["total"]


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
    source, tokenizer = ShardedLayers(folder, config, job.placement), load_tokenizer(str(folder))
    check_tokenizer(tokenizer, config, folder)
    blocks = calibration_blocks(job, tokenizer)  # refuses a job without text by name
    documents, eval_source, extra = held_out_documents(job, tokenizer, config.max_position_embeddings)
    text = PassText(blocks, recovery_length(job.text, config.max_position_embeddings), tuple(documents),
                    tuple(extra.items()))  # fmt: skip
    check_options(config, job.options)
    work = WorkFolder(start_work(dataclasses.replace(job, stream=True)))  # a killed run resumes from here
    shards = LayerShards(work, job.placement.torch_dtype)
    with atomic_folder(job.out, job.overwrite, (str(folder),)) as staging:
        passed = run_pass(source, job, text, shards, work, times)
        student_config = layer_config(source.model, passed.plan)
        report = streamed_report(job, passed, student_config)
        outer = write_outside_layers(source, staging, shards, times)
        if passed.documents is not None:
            report.saved_stage = "layer-wise" if passed.rows else "zero-shot"
            report.text = {"eval_text": eval_source, "eval_documents": len(documents),
                           "scoring_autocast": "bf16" if passed.documents.bf16 else None}  # fmt: skip
            with times.stage("scoring"):
                norm_and_head = source.norm_and_head(outer)
                report.scores = score_streams(passed.documents, passed.extra, norm_and_head, report.saved_stage)
        save_config(student_config, staging, shards.weight_map, shards.total, job.placement.dtype)
        tokenizer.save_pretrained(staging)
        report.seconds, report.stage_seconds = round(time.time() - started, 1), times.seconds
        write_model_card(staging, report)
    shutil.rmtree(work.folder, ignore_errors=True)  # saved: nothing left to resume
    print_report(report)
    form = f"{len(passed.rows)} layers fitted" if passed.rows else "closed form"
    print(f"\nstreamed {config.num_hidden_layers} layers into {job.out} ({report.seconds} s, {form})")
    return report


def streamed_report(job, passed: LayerPass, student_config) -> ConversionReport:
    """The report's settings and the layer-wise fit's rows; the scores follow."""
    plan = passed.plan
    return ConversionReport(
        source=public_name(job.source),
        options=dataclasses.asdict(plan.options),
        budget={**dataclasses.asdict(plan.budget), "kv_lora_rank": student_config.kv_lora_rank,
                **families.windowed_layers(student_config)},  # fmt: skip
        reconstruction={**dataclasses.asdict(job.reconstruction), "gate": passed.gate_rows, "layers": passed.rows},
        placement={"device": str(job.placement.torch_device()), "dtype": job.placement.dtype},
        candidates=plan.candidates,
        card=job_card(job),
        streamed=True,
    )


def write_outside_layers(source: ShardedLayers, staging: Path, shards: LayerShards, times: StageTimes) -> dict:
    """Every layer's shard linked into the output, and the tensors outside the layers written beside them (returned:
    the final norm and head score the streams)."""
    for name in sorted(set(shards.weight_map.values())):
        link_or_copy(shards.work.shards / name, staging / name)  # kept in the work folder until the output is saved
    with times.stage("embeddings and head"):
        outer = source.outer()
        student_outer = families.student_outer(source.config, outer)
        shards.total += write_shard(staging, "model-outer.safetensors", student_outer, shards.dtype, shards.weight_map)
    return outer


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
