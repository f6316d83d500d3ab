"""One decoder layer at a time. A `LayerSource` hands the conversion's passes (the split search, the layer pass) the
source's layers in order, with what runs around them (embeddings, rotary, final norm and head): a model in memory
(`ModelLayers`) or a checkpoint's safetensors files read a layer at a time with `safe_open` (`ShardedLayers`). Each
layer runs over hidden states kept on the host (`run_layer`); a layer is converted in closed form (`convert_layer`)
and its student layer built from its tensors (`student_layer`)."""

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

from ..configuration_egmla import EGMLAConfig
from ..modeling_egmla import EGMLAForCausalLM, look_up_gate_rows
from . import families
from .calibration import StatisticsRecorder
from .convert import ConversionPlan, LayerPlan, factorize_layer, layer_attention_state, layer_plan, student_config
from .source import SOURCE_CLASSES

SOURCE_LAYERS = {
    "llama": LlamaDecoderLayer,
    "mistral": MistralDecoderLayer,
    "qwen2": Qwen2DecoderLayer,
    "qwen3": Qwen3DecoderLayer,
    "gemma3_text": Gemma3DecoderLayer,
}


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


class ModelLayers:
    """A source model in memory: its own layers, where they are."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.config = model, model.config

    def embeddings(self) -> torch.Tensor:
        """The token embeddings [V, D] on the host, in the model's dtype, as the layers receive them (the streams
        start there)."""
        return families.scaled_embeddings(self.config, self.model.model.embed_tokens.weight.detach().cpu())

    def layer(self, layer_idx: int) -> torch.nn.Module:
        return self.model.model.layers[layer_idx]

    def rotary(self, layer: torch.nn.Module):
        """The source's rotary embedding as `layer` uses it."""
        return families.layer_rotary(self.model.model.rotary_emb, self.config, layer.self_attn.layer_idx)

    def norm_and_head(self) -> tuple[torch.nn.Module, torch.Tensor]:
        return self.model.model.norm, self.model.lm_head.weight


class ShardedLayers:
    """A checkpoint folder's safetensors files, a layer at a time, on the placement's device and dtype: memory holds
    one source layer, never the whole model."""

    def __init__(self, folder: Path, config, placement):
        self.files, self.model, self.config, self.placement = (
            SourceFiles(folder),
            weightless_source(config),
            config,
            placement,
        )

    def embeddings(self) -> torch.Tensor:
        weight = self.files.read("model.embed_tokens.")["weight"].to(self.placement.torch_dtype)
        return families.scaled_embeddings(self.config, weight)

    def layer(self, layer_idx: int) -> torch.nn.Module:
        return source_layer(self.model, self.files, layer_idx, self.placement)

    def rotary(self, layer: torch.nn.Module):
        """The source's rotary embedding as `layer` uses it, where it runs."""
        rotary = self.model.model.rotary_emb.to(layer.input_layernorm.weight.device)
        return families.layer_rotary(rotary, self.config, layer.self_attn.layer_idx)

    def outer(self) -> dict[str, torch.Tensor]:
        """The tensors outside the layers: the embeddings, the final norm, the head."""
        return self.files.read("", outside_layers=True)

    def norm_and_head(self, outer: dict | None = None) -> tuple[torch.nn.Module, torch.Tensor]:
        device, dtype = self.placement.torch_device(), self.placement.torch_dtype
        return final_norm_and_head(self.model, outer if outer is not None else self.outer(), device, dtype)


LayerSource = ModelLayers | ShardedLayers


@torch.no_grad()
def run_layer(layer: torch.nn.Module, hidden: torch.Tensor, rotary: torch.nn.Module, record: bool = True):
    """The layer's statistics (None unless `record`) and its outputs on `hidden` [N, S, D] (host), in batches of 8
    on the layer's device."""
    device, dtype, batch_size = layer.input_layernorm.weight.device, layer.input_layernorm.weight.dtype, 8
    recorder = StatisticsRecorder(layer.self_attn) if record else None
    handle = layer.self_attn.q_proj.register_forward_pre_hook(recorder) if record else None
    positions = torch.arange(hidden.shape[1], device=device)[None]
    # [1, 1, S, S] additive (within a windowed layer's window): what every attention implementation reads alike
    mask, outputs = families.layer_mask(layer.self_attn, hidden.shape[1], dtype, device, causal=True), torch.empty_like(hidden)
    rotation = rotary(hidden[:1].to(device), positions)  # [1, S, hd]: the same positions in every batch
    try:
        for start in range(0, len(hidden), batch_size):
            states = hidden[start : start + batch_size].to(device)
            output = layer(states, attention_mask=mask, position_ids=positions, position_embeddings=rotation)
            outputs[start : start + batch_size] = (output[0] if isinstance(output, tuple) else output).cpu()
    finally:
        if handle is not None:
            handle.remove()
    return (recorder.statistics() if record else None), outputs


def source_layer(source: torch.nn.Module, files: SourceFiles, layer_idx: int, placement) -> torch.nn.Module:
    """Decoder layer `layer_idx` of the source, read from its files onto the placement's device and dtype."""
    config = source.config
    with torch.device("meta"):
        layer = SOURCE_LAYERS[config.model_type](config, layer_idx)
    layer.load_state_dict(files.read(f"model.layers.{layer_idx}."), assign=True, strict=True)
    return layer.to(device=placement.torch_device(), dtype=placement.torch_dtype).eval()


def weightless_source(config) -> torch.nn.Module:
    """The source model without weights (meta), its rotary embedding real: what the config-level functions read."""
    with torch.device("meta"):
        source = SOURCE_CLASSES[config.model_type](config)
    source.model.rotary_emb = type(source.model.rotary_emb)(config=config)
    return source


def student_layer_state(source, layer, layer_idx: int, planned: LayerPlan, plan) -> dict[str, torch.Tensor]:
    """The student's tensors of one layer: the converted attention and the source's MLP and norms as they are."""
    scaling = families.attention_factor(source.model.rotary_emb, source.config, layer_idx)
    state = layer_attention_state(layer_idx, layer.self_attn, plan, planned, scaling)
    return state | families.layer_state(source.config, layer_idx, layer)


def convert_layer(source, layer, layer_idx: int, statistics, plan: ConversionPlan, rank: int | None = None) -> tuple:
    """Source layer `layer_idx` in closed form at `rank` (default: the budget's), one layer at a time: (the student
    layer's tensors, the layer's plan with its rope split and factors); the plan is added to `plan` with its tensors
    let go."""
    inv_freq = families.inv_freq(source.model.rotary_emb, source.config, layer_idx)
    split, factorization = factorize_layer(layer.self_attn, statistics, inv_freq, plan.budget, plan.options)
    planned = layer_plan(split, factorization, rank or plan.budget.kv_lora_rank)
    state = student_layer_state(source, layer, layer_idx, planned, plan)
    plan.layers.append(planned.built())
    return state, planned


def layer_config(source, plan: ConversionPlan) -> EGMLAConfig:
    """The student's config from the layers planned so far; layers not planned yet take the last one's rope
    frequencies (no layer is built from them before it is planned)."""
    missing = source.config.num_hidden_layers - len(plan.layers)
    return student_config(source, dataclasses.replace(plan, layers=plan.layers + plan.layers[-1:] * missing))


def student_layer(state: dict, layer_idx: int, config, like: torch.Tensor) -> tuple:
    """Student decoder layer `layer_idx` built from a copy of its `state`, on `like`'s device and dtype, and the
    student's rotary embedding there."""
    prefix = f"model.layers.{layer_idx}."
    with torch.device("meta"):
        skeleton = EGMLAForCausalLM(config)  # its layers get the attention implementation a loaded model has
    layer = skeleton.model.layers[layer_idx]
    # Copies: the state holds source tensors as they are (o_proj, the MLP), which fitting the student must not move.
    state = {
        name.removeprefix(prefix): tensor.detach().clone() for name, tensor in state.items() if name.startswith(prefix)
    }
    layer.load_state_dict(state, assign=True)
    layer = layer.to(device=like.device, dtype=like.dtype).eval().requires_grad_(False)
    return layer, type(skeleton.model.rotary_emb)(config=config, rope_theta=layer_rope_theta(config, layer_idx)).to(
        like.device
    )


def layer_rope_theta(config: EGMLAConfig, layer_idx: int) -> float | None:
    """The base of a student layer's own rotary (a windowed layer's `sliding_rope_theta`), None for the model's."""
    return config.sliding_rope_theta if config.layer_window(layer_idx) is not None else None


@torch.no_grad()
def student_layer_output(layer: torch.nn.Module, hidden: torch.Tensor, rotary: torch.nn.Module, gate=None):
    """A student decoder layer's outputs on `hidden` [N, S, D] (host), computed on the layer's device, causally;
    `gate`: (its gate table, the token ids [N, S]) where the layer has a gate."""
    states = hidden.to(layer.input_layernorm.weight.device)
    positions = torch.arange(states.shape[1], device=states.device)[None]
    gate_rows = None
    if gate is not None:
        table, ids = gate
        (gate_rows,) = look_up_gate_rows(torch.nn.ModuleList([table]), ids.to(states.device))
    mask = families.layer_mask(layer.self_attn, states.shape[1], states.dtype, states.device)
    return layer(states, attention_mask=mask, position_embeddings=rotary(states, positions), gate_rows=gate_rows).cpu()


def final_norm_and_head(source, outer: dict, device, dtype) -> tuple[torch.nn.Module, torch.Tensor]:
    """The source's final norm and head (the embeddings where they are tied) from its tensors outside the layers."""
    norm = type(source.model.norm)(source.config.hidden_size, eps=source.config.rms_norm_eps)
    norm.weight.data = outer["model.norm.weight"]
    head = outer.get("lm_head.weight", outer["model.embed_tokens.weight"])
    return norm.to(device=device, dtype=dtype), head.to(device=device, dtype=dtype)
