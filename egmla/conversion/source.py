"""The source of a conversion: a Llama-family checkpoint (Llama, Mistral, Qwen2, Qwen3) from an instance, a local folder, a
Hub id or a GGUF file, and its tokenizer."""

import copy
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoTokenizer,
    Gemma3ForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

from ..options import DTYPES, Placement
from . import families

# The families whose attention is Llama's up to biases and windows: the same modules under the same names.
# Qwen3 and Gemma 3 are Llama's with each query and key head RMS-normed before RoPE (`qk_norm` in the student);
# Gemma 3's other differences are carried by `families.py`.
SOURCE_CLASSES = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
}
ACCEPTED = (
    "Llama, Mistral, Qwen2, Qwen3 or Gemma 3 text (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
    "Qwen3ForCausalLM, Gemma3ForCausalLM; MHA or GQA)"
)
QK_NORM_SOURCES = ("qwen3", "gemma3_text")
# QK-norm families whose layers differ from Llama's beyond what is carried (experts, other norms, the vision tower),
# refused by name.
QK_NORM_FAMILIES = ("qwen3_moe", "gemma3", "olmo2", "olmo3", "cohere2")


@dataclass(frozen=True)
class AttentionShape:
    """A source's attention shape: the size of each head and the number of query and key/value heads."""

    head_dim: int
    query_heads: int
    key_heads: int

    @property
    def key_value_values(self) -> int:
        """K/V values the source caches per token per layer."""
        return 2 * self.key_heads * self.head_dim


def attention_shape(config) -> AttentionShape:
    """The attention shape of a Llama, Mistral, Qwen2 or Qwen3 config, each field at its family's default where the config
    leaves it out: Qwen2's config has no `head_dim` (its attention uses hidden_size // num_attention_heads), Mistral's
    may hold None, and an absent `num_key_value_heads` means one per query head (MHA)."""
    query_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // query_heads
    key_heads = getattr(config, "num_key_value_heads", None) or query_heads
    return AttentionShape(head_dim, query_heads, key_heads)


def key_norm_heads(config) -> int:
    """The key-norm scales a converted layer caches per token: one per key head of a QK-norm source (Qwen3)."""
    return attention_shape(config).key_heads if config.model_type in QK_NORM_SOURCES else 0


def split_gguf(source: str | Path) -> tuple[str, str | None]:
    """A path to a `.gguf` file -> (its folder, its file name); anything else -> (source, None)."""
    path = Path(source)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file {path} does not exist.")
        return str(path.parent), path.name
    return str(source), None


def load_llama(source: str | Path | PreTrainedModel, placement: Placement | None = None) -> LlamaForCausalLM:
    """A Llama, Mistral or Qwen2 causal LM from an instance, a local folder, a Hub id or a GGUF file, on the
    placement's device in its dtype (default: an instance's own device and dtype, float32 unless it is bfloat16 or
    float16; a checkpoint on this process's accelerator, else the CPU, in float32)."""
    if isinstance(source, PreTrainedModel) and placement is None:
        dtype = str(source.dtype).removeprefix("torch.")
        placement = Placement(device=str(source.device), dtype=dtype if dtype in DTYPES else "float32")
    placement = placement or Placement()
    device, dtype = placement.torch_device(), placement.torch_dtype
    if isinstance(source, PreTrainedModel):
        check_family(source.config.model_type, type(source).__name__)
        # Work on a copy when the dtype, device or mode would change: the caller's model is never modified.
        unchanged = source.dtype == dtype and source.device == device and not source.training
        model = source if unchanged else copy.deepcopy(source)
    else:
        model = load_llama_checkpoint(source, dtype, device)
    if not isinstance(model, tuple(SOURCE_CLASSES.values())):
        raise ValueError(f"Got a {type(model).__name__}; only {ACCEPTED} sources can be converted.")
    check_supported(model.config)
    check_finite(model)
    return model.to(device=device, dtype=dtype).eval()


def check_finite(model: PreTrainedModel, whose: str = "The source's") -> None:
    """NaN or inf in a checkpoint would silently spread through every factorization, fit and score: refuse them by
    name."""
    for name, parameter in model.named_parameters():
        if not torch.isfinite(parameter).all():
            raise ValueError(
                f"{whose} weight {name} holds NaN or inf values: the checkpoint is damaged (re-download or "
                "re-export it); nothing was done."
            )


def read_config(source: str | Path, role: str = "source") -> PretrainedConfig:
    """A checkpoint's config, read before its weights or any text: a clear error for a path that does not exist, a
    folder without config.json, or an id that is neither a local path nor a Hub model reachable from here."""
    folder, gguf_file = split_gguf(source)
    if Path(folder).is_dir() and gguf_file is None and not (Path(folder) / "config.json").is_file():
        raise ValueError(
            f"The {role} {source} has no config.json: give a checkpoint folder as save_pretrained writes it."
        )
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
    except (OSError, ValueError) as error:  # no such path or Hub id, offline, not a config
        where = "is not a local folder or file, nor" if not Path(folder).exists() else "could not be read as"
        raise ValueError(
            f"The {role} {source} {where} a Hub model reachable from here ({str(error).splitlines()[0]}): give a "
            "local checkpoint folder, a .gguf file or a Hub id."
        ) from error
    if gguf_file is not None:
        gguf_head_dim(config, Path(folder) / gguf_file)
    return config


def gguf_head_dim(config: PretrainedConfig, path: Path) -> None:
    """transformers maps no `attention.key_length` for some architectures (Qwen3), so their config takes its default
    head_dim whatever the file's: the file's own is set here (the weights then load in their shapes)."""
    reader = gguf.GGUFReader(path)
    architecture = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{architecture}.attention.key_length")
    if field is not None and hasattr(config, "head_dim"):
        config.head_dim = int(field.contents())


def source_config(source: str | Path) -> PretrainedConfig:
    """The config of a conversion's source, refused by name unless it is a family and shape EG-MLA converts."""
    config = read_config(source)
    check_family(config.model_type, source)
    check_supported(config)
    return config


def check_tokenizer(tokenizer: PreTrainedTokenizerBase, config, source: str | Path) -> None:
    """A tokenizer whose ids reach past the model's embedding rows would index outside it: refuse it by name."""
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"The tokenizer of {source} has {len(tokenizer):,} tokens, more than the model's vocab_size "
            f"{config.vocab_size:,}: its ids past {config.vocab_size - 1} have no embedding. Give the tokenizer "
            "that came with the model."
        )


def check_family(model_type: str, source: str | Path) -> None:
    if model_type in QK_NORM_FAMILIES:
        raise ValueError(
            f"{source} is a {model_type!r} checkpoint: its query and key heads are normed (QK-norm), which egmla "
            "converts for Qwen3 and Gemma 3's text model, but its layers differ from theirs beyond that (experts, "
            f"other norms, a vision tower) and are not carried yet; sources must be {ACCEPTED}."
        )
    if model_type not in SOURCE_CLASSES:
        raise ValueError(f"{source} is a {model_type!r} checkpoint; only {ACCEPTED} sources can be converted.")


def load_llama_checkpoint(source: str | Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    folder, gguf_file = split_gguf(source)
    config = source_config(source)
    model_class = SOURCE_CLASSES[config.model_type]
    try:  # straight onto the device, in the dtype: no float32 copy on the host first
        model = model_class.from_pretrained(folder, gguf_file=gguf_file, config=config, dtype=dtype, device_map=device)
    except (OSError, SafetensorError) as error:  # missing or unreadable weights
        raise ValueError(
            f"Could not read the weights of {source} ({error}): the folder needs its model.safetensors (or "
            "pytorch_model.bin) as saved by save_pretrained; re-download or re-export the checkpoint."
        ) from error
    if gguf_file is not None:
        # De-quantized on load: the GGUF quantization no longer describes these weights.
        del model.config.quantization_config
        model.hf_quantizer, model.is_quantized = None, False
    return model


def check_supported(config) -> None:
    """Refuses what EG-MLA has nothing to map to."""
    check_sliding_window(config)
    families.check_carried(config)
    if getattr(config, "mlp_bias", False):
        raise ValueError("The source has MLP biases (mlp_bias=True); EG-MLA's SwiGLU MLP has none.")
    rope = families.rope_parameters(config, families.global_layer(config))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("Sources with partial_rotary_factor != 1 are not supported.")
    if rope.get("rope_type", "default") == "longrope":
        raise ValueError("Sources with longrope scaling are not supported (its frequencies depend on the length).")


def check_sliding_window(config) -> None:
    """A sliding window attends to the last `sliding_window` tokens only; EG-MLA attends to every cached token, so a
    window is accepted only where it covers the whole context (Mistral v0.2+ and Qwen2 have none by default)."""
    if families.is_gemma3(config):  # its windowed layers are carried as they are (`sliding_window_layers`)
        return
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    slides = config.model_type == "mistral" or "sliding_attention" in layer_types
    if slides and window is not None and window < config.max_position_embeddings:
        raise ValueError(
            f"The source uses sliding-window attention (sliding_window={window} < max_position_embeddings="
            f"{config.max_position_embeddings}); EG-MLA attends to the whole context, which would change the "
            "model: only sources whose window covers the context (or that have none) can be converted."
        )


def load_tokenizer(source: str | Path | PreTrainedModel) -> PreTrainedTokenizerBase:
    name = source.config.name_or_path if isinstance(source, PreTrainedModel) else source
    if not name:
        raise ValueError("This in-memory model has no name_or_path to find its tokenizer by: pass token ids.")
    folder, gguf_file = split_gguf(name)
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"Could not load a tokenizer from {name} ({str(error).splitlines()[0]}): the source folder needs its "
            "tokenizer files (tokenizer.json, tokenizer_config.json) beside the weights; copy them from the model "
            "it came from."
        ) from error
