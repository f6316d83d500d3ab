"""The source of a conversion: a Llama checkpoint from an instance, a local folder, a Hub id or a GGUF file, and
its tokenizer."""

import copy
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase


def split_gguf(source: str | Path) -> tuple[str, str | None]:
    """A path to a `.gguf` file -> (its folder, its file name); anything else -> (source, None)."""
    path = Path(source)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file {path} does not exist.")
        return str(path.parent), path.name
    return str(source), None


def load_llama(source: str | Path | PreTrainedModel) -> LlamaForCausalLM:
    """A `LlamaForCausalLM` from an instance, a local folder, a Hub id or a GGUF file, in float32."""
    if isinstance(source, PreTrainedModel):
        # Work on a copy when the dtype or mode would change: the caller's model is never modified.
        model = source if source.dtype == torch.float32 and not source.training else copy.deepcopy(source)
    else:
        model = load_llama_checkpoint(source)
    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(
            f"Got a {type(model).__name__}; only Llama (LlamaForCausalLM, MHA or GQA) sources can be converted."
        )
    check_supported(model.config)
    check_finite(model)
    return model.to(torch.float32).eval()


def check_finite(model: PreTrainedModel) -> None:
    """NaN or inf in the source would silently spread through every factorization: refuse them by name."""
    for name, parameter in model.named_parameters():
        if not torch.isfinite(parameter).all():
            raise ValueError(
                f"The source's weight {name} holds NaN or inf values: the checkpoint is damaged (re-download or "
                "re-export it); nothing was converted."
            )


def load_llama_checkpoint(source: str | Path) -> LlamaForCausalLM:
    folder, gguf_file = split_gguf(source)
    config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
    if config.model_type != "llama":
        raise ValueError(
            f"{source} is a {config.model_type!r} checkpoint; only Llama (LlamaForCausalLM, MHA or GQA) "
            "sources can be converted."
        )
    try:
        model = LlamaForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    except (OSError, SafetensorError) as error:  # missing or unreadable weights
        raise ValueError(
            f"Could not read the weights of {source} ({error}): the folder needs its model.safetensors (or "
            "pytorch_model.bin) as saved by save_pretrained; re-download or re-export the checkpoint."
        ) from error
    if gguf_file is not None:
        # De-quantized to float32 on load: the GGUF quantization no longer describes these weights.
        del model.config.quantization_config
        model.hf_quantizer, model.is_quantized = None, False
    return model


def check_supported(config) -> None:
    """Refuses what EG-MLA has nothing to map to."""
    if config.attention_bias:
        raise ValueError("The source has attention biases (attention_bias=True); EG-MLA has none to map them to.")
    if getattr(config, "mlp_bias", False):
        raise ValueError("The source has MLP biases (mlp_bias=True); EG-MLA's SwiGLU MLP has none.")
    if config.rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("Sources with partial_rotary_factor != 1 are not supported.")
    if config.rope_parameters.get("rope_type", "default") == "longrope":
        raise ValueError("Sources with longrope scaling are not supported (its frequencies depend on the length).")


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
