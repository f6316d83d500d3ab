"""Streaming conversion (`egmla convert --stream`): the source is read one decoder layer at a time from its
safetensors files (`safe_open`), calibrated on the hidden states the layer before it produced (kept on the host in
the chosen dtype), factorized, fitted by the layer-wise fit (as the whole-model conversion fits it, on the source's
and the student's streams, also kept on the host), and its student layer written as a shard of its own; peak memory
is one source layer and one student layer, the embeddings and the activations, not two whole models. With the split
left to the search, a first pass streams the layers for it (`stream_search.py`) and the conversion reads the
statistics it saved. The gate, the recovery and the held-out scoring need the whole model: streaming does without
them."""

import dataclasses
import json
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoConfig, GenerationConfig
from transformers.dynamic_module_utils import custom_object_save

from ..hub import public_name, source_metadata
from ..modeling_egmla import EGMLAForCausalLM
from ..outputs import atomic_folder, check_output_folder
from ..text import token_blocks
from .calibration import source_layer_pass
from .convert import Budget, ConversionOptions, ConversionPlan, factorize_layer, resolve_budget
from .layer_stream import (
    SourceFiles,
    layer_config,
    run_layer,
    source_layer,
    source_shell,
    student_layer,
    student_layer_state,
)
from .pipeline import layer_wise_inputs, recovery_length, split_train_text
from .reconstruction import LayerStreams, ReconstructionSettings, StudentBlock, fit_layer, next_student_stream
from .report import write_model_card
from .source import check_family, check_supported, load_tokenizer
from .stream_search import load_statistics, streamed_split_search
from .timing import StageTimes


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
    return token_blocks(tokenizer, documents, job.text.block_size)[: job.text.calibration_blocks]


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
    layer, source_out = source_layer_pass(source, source_in, source_rotary(source_in, positions))
    streams = LayerStreams(student_in, layer.hidden, layer.hidden + layer.attention)
    block = StudentBlock(student, None, False)
    row = fit_layer(block, streams, blocks, rotary, fitting.settings)
    fitting.student = next_student_stream(block, streams, blocks, rotary).cpu()
    fitting.source = source_out.cpu()
    return {prefix + name: tensor for name, tensor in student.state_dict().items()}, row


def layer_by_layer(shell, files: SourceFiles, job, budget: Budget, staging: Path, blocks, statistics_folder) -> tuple:
    """Every layer read, calibrated on `blocks` (or its statistics read from `statistics_folder`, where the split
    search saved them), factorized, fitted and written: (each layer's rope frequencies, the weight map, the bytes
    written, the layer-wise fit's rows)."""
    options, placement = job.options, job.placement
    embeddings = files.read("model.embed_tokens.")["weight"]
    hidden = None if statistics_folder else torch.nn.functional.embedding(blocks, embeddings).to(placement.torch_dtype)
    fitting = fitting_streams(blocks, embeddings, job, shell.config.max_position_embeddings)
    inv_freq = shell.model.rotary_emb.inv_freq.float().cpu()
    plan = ConversionPlan(options, budget, [], [], [])  # the shape; the splits and factors come layer by layer
    frequencies, weight_map, total, rows = [], {}, 0, []
    for layer_idx in tqdm(range(shell.config.num_hidden_layers), desc="streaming layers", unit="layer", leave=False):
        layer = source_layer(shell, files, layer_idx, placement)
        rotary = shell.model.rotary_emb.to(layer.input_layernorm.weight.device)
        if statistics_folder:
            statistics = load_statistics(statistics_folder, layer_idx)
        else:
            statistics, hidden = run_layer(layer, hidden, rotary)
        split, factorization = factorize_layer(layer.self_attn, statistics, inv_freq, budget, options)
        state = student_layer_state(shell, layer, layer_idx, (split, factorization.truncate(budget.kv_lora_rank)), plan)
        frequencies.append(split.frequencies)
        if fitting is not None:
            config = layer_config(shell, options, budget, frequencies)
            state, row = fit_streamed_layer(layer, layer_idx, state, config, fitting, rotary)
            rows.append(row)
        total += write_shard(
            staging, f"model-layer-{layer_idx:05d}.safetensors", state, placement.torch_dtype, weight_map
        )
        del layer, state, split, factorization  # one layer at a time
    return frequencies, weight_map, total, rows


def run_streaming_conversion(job) -> dict:
    """Converts `job.source` (a local folder of safetensors) layer by layer into `job.out`: the split search's pass
    where the split is left to it, then the conversion's (the closed form, and the layer-wise fit unless it is off)."""
    folder = Path(job.source)
    if not folder.is_dir():
        raise ValueError(f"--stream reads a local folder of safetensors files; {job.source} is not one.")
    check_output_folder(job.out, job.overwrite, (str(folder),))
    started = time.time()
    config = AutoConfig.from_pretrained(folder)
    check_family(config.model_type, job.source)
    check_supported(config)
    check_streamable(job.options)
    files, shell, tokenizer, times = (
        SourceFiles(folder),
        source_shell(config),
        load_tokenizer(str(folder)),
        StageTimes(),
    )
    blocks = calibration_blocks(job, tokenizer)
    with atomic_folder(job.out, job.overwrite, (str(folder),)) as staging:
        with tempfile.TemporaryDirectory(dir=staging, prefix=".statistics-") as saved:
            searching = times.stage("split search") if job.options.rope_split == "auto" else nullcontext()
            with searching:  # a pass of its own over the layers
                options, candidates = streamed_split_search(shell, files, job, blocks, Path(saved))
            job, budget = dataclasses.replace(job, options=options), resolve_budget(config, options)
            with times.stage("layers"):
                statistics = Path(saved) if candidates else None
                frequencies, weight_map, total, rows = layer_by_layer(
                    shell, files, job, budget, staging, blocks, statistics
                )
        with times.stage("embeddings and head"):
            outer = files.read("", outside_layers=True)
            total += write_shard(staging, "model-outer.safetensors", outer, job.placement.torch_dtype, weight_map)
        save_config(layer_config(shell, options, budget, frequencies), staging, weight_map, total, job.placement.dtype)
        tokenizer.save_pretrained(staging)
        report = {
            "source": public_name(job.source),
            "options": dataclasses.asdict(options),
            "budget": dataclasses.asdict(budget),
            "candidates": candidates,
            "streamed": True,
            "seconds": round(time.time() - started, 1),
            "reconstruction": {**dataclasses.asdict(job.reconstruction), "layers": rows},
            "stage_seconds": times.seconds,
            "placement": {"device": str(job.placement.torch_device()), "dtype": job.placement.dtype},
        }
        metadata = source_metadata(job.source, job.base_model, job.license)
        report["card"] = {**dataclasses.asdict(metadata), "model_name": Path(job.out).name}
        write_model_card(staging, report)
    form = f"{len(rows)} layers fitted" if rows else "closed form"
    print(f"streamed {config.num_hidden_layers} layers into {job.out} ({report['seconds']} s, {form})")
    return report


def save_config(config, staging: Path, weight_map: dict, total: int, dtype: str) -> None:
    """config.json with the remote-code files and `auto_map`, the generation config and the shards' index."""
    config.dtype = dtype
    with torch.device("meta"):
        custom_object_save(EGMLAForCausalLM(config), staging, config=config)
    config.save_pretrained(staging)
    GenerationConfig.from_model_config(config).save_pretrained(staging)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
