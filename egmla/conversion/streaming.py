"""Streaming conversion (`egmla convert --stream`): the source is read one decoder layer at a time from its
safetensors files (`safe_open`), calibrated on the hidden states the layer before it produced (kept on the host in
the chosen dtype), factorized, fitted by the layer-wise fit (as the whole-model conversion fits it, on the source's
and the student's streams, also kept on the host), and its student layer written as a shard of its own; peak memory
is one source layer and one student layer, the embeddings and the activations, not two whole models. The split
search, the gate, the recovery and the held-out scoring each need the whole model: streaming does without them."""

import dataclasses
import json
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoConfig, GenerationConfig
from transformers.dynamic_module_utils import custom_object_save
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

from ..configuration_egmla import EGMLAConfig
from ..hub import public_name, source_metadata
from ..modeling_egmla import EGMLAForCausalLM
from ..outputs import atomic_folder, check_output_folder
from ..text import token_blocks
from .calibration import StatisticsRecorder, source_layer_pass
from .convert import (
    Budget,
    ConversionOptions,
    ConversionPlan,
    cut_values,
    factorize_layer,
    layer_attention_state,
    resolve_budget,
    student_config,
)
from .pipeline import layer_wise_inputs, recovery_length, split_train_text
from .reconstruction import LayerStreams, ReconstructionSettings, StudentBlock, fit_layer, next_student_stream
from .report import write_model_card
from .rope import RopeSplit
from .search import ROPE_SHARES, shared_key_pairs
from .source import SOURCE_CLASSES, check_family, check_supported, load_tokenizer
from .timing import StageTimes

SOURCE_LAYERS = {"llama": LlamaDecoderLayer, "mistral": MistralDecoderLayer, "qwen2": Qwen2DecoderLayer}
# The share of the cut's values the rope key takes when the search cannot run: a quarter, the search's choice on
# stories260K and SmolLM2-135M alike.
STREAMED_ROPE_SHARE = 0.25
assert STREAMED_ROPE_SHARE in ROPE_SHARES


class SourceFiles:
    """A checkpoint folder's safetensors files, read a tensor group at a time."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.exists():
            self.weight_map = json.loads(index.read_text())["weight_map"]
        elif (folder / "model.safetensors").exists():
            with safe_open(folder / "model.safetensors", "pt") as weights:
                self.weight_map = dict.fromkeys(weights.keys(), "model.safetensors")
        else:
            raise ValueError(f"--stream reads safetensors: {folder} has no model.safetensors (or its index).")
        self.folder = folder

    def read(self, prefix: str, outside_layers: bool = False) -> dict[str, torch.Tensor]:
        """Every tensor whose name starts with `prefix`, named without it (with `outside_layers`, none of the decoder
        layers': the embeddings, the final norm, the head)."""
        names = [name for name in self.weight_map if name.startswith(prefix)]
        if outside_layers:
            names = [name for name in names if not name.startswith("model.layers.")]
        tensors = {}
        for file in sorted({self.weight_map[name] for name in names}):
            with safe_open(self.folder / file, "pt") as weights:
                tensors.update(
                    {name[len(prefix) :]: weights.get_tensor(name) for name in names if name in weights.keys()}
                )
        return tensors


def streamed_options(options: ConversionOptions, config) -> ConversionOptions:
    """The options as streaming can convert them: the search's "auto" becomes a shared rope key of a quarter of the
    cut's values (its usual choice); per-layer ranks by energy need every layer's spectrum at once."""
    if options.rank_allocation != "uniform":
        raise ValueError("--stream allocates ranks uniformly: rank_allocation='energy' needs every layer at once.")
    if options.gate_embedding_dim > 0:
        raise ValueError("--stream converts without the gate (gate_embedding_dim=0): its tables span layers.")
    if options.rope_split != "auto":
        return options
    values = options.kv_lora_rank if options.kv_cut is None else cut_values(config, options.kv_cut)
    pairs = shared_key_pairs(values, STREAMED_ROPE_SHARE)
    return dataclasses.replace(options, rope_split="shared", rope_pairs=pairs)


def causal_mask(length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1, 1, S, S] additive: what every attention implementation of a source layer reads alike."""
    blocked = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(length, length, dtype=dtype, device=device).masked_fill(blocked, torch.finfo(dtype).min)[
        None, None
    ]


@torch.no_grad()
def run_layer(layer: torch.nn.Module, hidden: torch.Tensor, rotary: torch.nn.Module, batch_size: int = 8):
    """The layer's statistics and its outputs on `hidden` [N, S, D] (host), in batches on the layer's device."""
    device, dtype = layer.input_layernorm.weight.device, layer.input_layernorm.weight.dtype
    recorder = StatisticsRecorder(layer.self_attn)
    handle = layer.self_attn.q_proj.register_forward_pre_hook(recorder)
    positions = torch.arange(hidden.shape[1], device=device)[None]
    mask, outputs = causal_mask(hidden.shape[1], dtype, device), torch.empty_like(hidden)
    rotation = rotary(hidden[:1].to(device), positions)  # [1, S, hd]: the same positions in every batch
    try:
        for start in range(0, len(hidden), batch_size):
            states = hidden[start : start + batch_size].to(device)
            output = layer(states, attention_mask=mask, position_ids=positions, position_embeddings=rotation)
            outputs[start : start + batch_size] = (output[0] if isinstance(output, tuple) else output).cpu()
    finally:
        handle.remove()
    return recorder.statistics(), outputs


def source_layer(shell: torch.nn.Module, files: SourceFiles, layer_idx: int, placement) -> torch.nn.Module:
    """Decoder layer `layer_idx` of the source, read from its files onto the placement's device and dtype."""
    config = shell.config
    with torch.device("meta"):
        layer = SOURCE_LAYERS[config.model_type](config, layer_idx)
    layer.load_state_dict(files.read(f"model.layers.{layer_idx}."), assign=True, strict=True)
    return layer.to(device=placement.torch_device(), dtype=placement.torch_dtype).eval()


def source_shell(config) -> torch.nn.Module:
    """The source model without weights (meta), its rotary embedding real: what the config-level functions read."""
    with torch.device("meta"):
        shell = SOURCE_CLASSES[config.model_type](config)
    shell.model.rotary_emb = type(shell.model.rotary_emb)(config=config)
    return shell


def student_layer_state(shell, layer, layer_idx: int, converted: tuple, plan) -> dict[str, torch.Tensor]:
    """The student's tensors of one layer: the converted attention and the source's MLP and norms as they are."""
    state = layer_attention_state(layer_idx, layer.self_attn, plan, converted, shell.model.rotary_emb.attention_scaling)
    prefix = f"model.layers.{layer_idx}."
    for name, tensor in layer.state_dict().items():
        if not name.startswith("self_attn."):
            state[prefix + name] = tensor
    return state


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


def layer_config(shell, options: ConversionOptions, budget: Budget, frequencies: list) -> EGMLAConfig:
    """The student's config from each converted layer's rope frequencies; layers not converted yet take the last
    one's (no layer is built from them before it is converted)."""
    layers = frequencies + frequencies[-1:] * (shell.config.num_hidden_layers - len(frequencies))
    splits = [RopeSplit(layer, *(torch.empty(0),) * 4) for layer in layers]  # student_config reads these only
    return student_config(shell, ConversionPlan(options, budget, splits, [], [budget.kv_lora_rank] * len(splits)))


def fit_streamed_layer(source, layer_idx: int, state: dict, config, fitting: FittingStreams, source_rotary):
    """Student layer `layer_idx`, built from its closed-form `state`, fitted to the `source` layer as the whole-model
    conversion fits it; both streams advance past the layer. Returns its fitted state and its report row."""
    device, dtype = source.input_layernorm.weight.device, source.input_layernorm.weight.dtype
    prefix = f"model.layers.{layer_idx}."
    with torch.device("meta"):
        shell = EGMLAForCausalLM(config)  # its layers get the attention implementation a loaded model has
    student = shell.model.layers[layer_idx]
    student.load_state_dict({name.removeprefix(prefix): tensor for name, tensor in state.items()}, assign=True)
    student = student.to(device=device, dtype=dtype).eval().requires_grad_(False)
    blocks, source_in, student_in = (tensor.to(device) for tensor in (fitting.blocks, fitting.source, fitting.student))
    positions = torch.arange(blocks.shape[1], device=device)[None]
    rotary = type(shell.model.rotary_emb)(config=config).to(device)(student_in, positions)
    layer, source_out = source_layer_pass(source, source_in, source_rotary(source_in, positions))
    streams = LayerStreams(student_in, layer.hidden, layer.hidden + layer.attention)
    block = StudentBlock(student, None, False)
    row = fit_layer(block, streams, blocks, rotary, fitting.settings)
    fitting.student = next_student_stream(block, streams, blocks, rotary).cpu()
    fitting.source = source_out.cpu()
    return {prefix + name: tensor for name, tensor in student.state_dict().items()}, row


def layer_by_layer(shell, files: SourceFiles, job, budget: Budget, staging: Path, tokenizer) -> tuple:
    """Every layer read, calibrated, factorized, fitted and written: (each layer's rope frequencies, the weight map,
    the bytes written, the layer-wise fit's rows)."""
    options, placement = job.options, job.placement
    blocks, embeddings = calibration_blocks(job, tokenizer), files.read("model.embed_tokens.")["weight"]
    hidden = torch.nn.functional.embedding(blocks, embeddings).to(placement.torch_dtype)
    fitting = fitting_streams(blocks, embeddings, job, shell.config.max_position_embeddings)
    inv_freq = shell.model.rotary_emb.inv_freq.float().cpu()
    plan = ConversionPlan(options, budget, [], [], [])  # the shape; the splits and factors come layer by layer
    frequencies, weight_map, total, rows = [], {}, 0, []
    for layer_idx in tqdm(range(shell.config.num_hidden_layers), desc="streaming layers", unit="layer", leave=False):
        layer = source_layer(shell, files, layer_idx, placement)
        rotary = shell.model.rotary_emb.to(layer.input_layernorm.weight.device)
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
    """Converts `job.source` (a local folder of safetensors) in closed form, layer by layer, into `job.out`."""
    folder = Path(job.source)
    if not folder.is_dir():
        raise ValueError(f"--stream reads a local folder of safetensors files; {job.source} is not one.")
    check_output_folder(job.out, job.overwrite, (str(folder),))
    started = time.time()
    config = AutoConfig.from_pretrained(folder)
    check_family(config.model_type, job.source)
    check_supported(config)
    options = streamed_options(job.options, config)
    job = dataclasses.replace(job, options=options)
    files, shell, budget = SourceFiles(folder), source_shell(config), resolve_budget(config, options)
    tokenizer, times = load_tokenizer(str(folder)), StageTimes()
    with atomic_folder(job.out, job.overwrite, (str(folder),)) as staging:
        with times.stage("layers"):
            frequencies, weight_map, total, rows = layer_by_layer(shell, files, job, budget, staging, tokenizer)
        with times.stage("embeddings and head"):
            outer = files.read("", outside_layers=True)
            total += write_shard(staging, "model-outer.safetensors", outer, job.placement.torch_dtype, weight_map)
        save_config(layer_config(shell, options, budget, frequencies), staging, weight_map, total, job.placement.dtype)
        tokenizer.save_pretrained(staging)
        report = {"source": public_name(job.source), "options": dataclasses.asdict(options),
                  "budget": dataclasses.asdict(budget), "streamed": True, "seconds": round(time.time() - started, 1),
                  "reconstruction": {**dataclasses.asdict(job.reconstruction), "layers": rows},
                  "stage_seconds": times.seconds, "placement": {"device": str(job.placement.torch_device()),
                  "dtype": job.placement.dtype}}  # fmt: skip
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
