"""What the tests share: tiny random EG-MLA and Llama models, the real stories260K checkpoint (in the repository),
the TinyStories text in ../shared (skipped when absent), and the cached-against-uncached helpers."""

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from egmla import EGMLACache, EGMLAConfig, EGMLAForCausalLM

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
STORIES260K = Path(__file__).resolve().parent / "assets" / "stories260K-hf"  # MIT, see assets/README.md
# TinyStories training text: the 2 MiB shard in ../shared, else the package's embedded excerpt (490 stories).
TINYSTORIES = SHARED / "assets" / "text" / "tinystories_train_2MiB.txt"
if not TINYSTORIES.exists():
    TINYSTORIES = Path(__file__).resolve().parents[1] / "egmla" / "data" / "tinystories_excerpt.txt"

QK_NORM = {"qk_norm_head_dim": 12, "qk_norm_key_heads": 2}
# Gemma 3's layer: norms on the attention's and MLP's outputs, a scaled embedding, GELU-tanh, and a windowed layer
# with its own RoPE base (a window shorter than the tests' sequences).
GEMMA_LAYERS = {"sandwich_norms": True, "embedding_multiplier": 8.0, "hidden_act": "gelu_pytorch_tanh",
                "sliding_window": 5, "sliding_window_layers": [0], "sliding_rope_theta": 100.0}  # fmt: skip
# The cache modes: gate off (plain MLA, both decode paths), gate on the up-projected K/V, gate on the latent;
# each with the decoupled rope key, and with the RoPE-exact latent.
MODES = {
    "mla": {"gate_embedding_dim": 0, "gate_position": "kv"},
    "mla-absorbed": {"gate_embedding_dim": 0, "gate_position": "latent"},
    "gate-kv": {"gate_embedding_dim": 16, "gate_position": "kv"},
    "gate-latent": {"gate_embedding_dim": 16, "gate_position": "latent"},
    # RoPE-exact latent: every key rebuilt from the latent and rotated at its cached position (no rope key).
    "exact": {"gate_embedding_dim": 0, "gate_position": "kv", "rope_mode": "exact"},
    "exact-gate-kv": {"gate_embedding_dim": 16, "gate_position": "kv", "rope_mode": "exact"},
    "exact-gate-latent": {"gate_embedding_dim": 16, "gate_position": "latent", "rope_mode": "exact"},
    # QK-norm (Qwen3's): the source's query normed per head, each key's norm cached as a scale per key head; the
    # absorbed decode, and the rebuilding one.
    "qk-norm": {"gate_embedding_dim": 0, "gate_position": "latent", "qk_norm": True, **QK_NORM},
    "qk-norm-gate-kv": {"gate_embedding_dim": 16, "gate_position": "kv", "qk_norm": True, **QK_NORM},
    # Gemma 3's layers (absorbed decode), and a windowed layer whose rebuilt keys turn with its own base.
    "gemma": {"gate_embedding_dim": 0, "gate_position": "latent", "qk_norm": True, **QK_NORM, **GEMMA_LAYERS},
    "windowed-exact-gate-kv": {"gate_embedding_dim": 16, "gate_position": "kv", "rope_mode": "exact", **GEMMA_LAYERS},
}

TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "gate_embedding_dim": 16,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# One attention layer for the kernel tests: a wider NoPE part than rope part, an odd latent width.
KERNEL = {
    **TINY,
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "kv_lora_rank": 24,
    "qk_nope_head_dim": 16,
    "gate_embedding_dim": 10,
    "max_position_embeddings": 128,
    "pad_token_id": None,
}

# A whole model for the fused-generate tests: two rope keys, few distinct tokens.
FUSED = {
    **TINY,
    "vocab_size": 80,
    "hidden_size": 32,
    "intermediate_size": 48,
    "v_head_dim": 8,
    "rope_key_heads": 2,
    "gate_embedding_dim": 8,
    "max_position_embeddings": 128,
}


def tiny_config(base: dict = TINY, **overrides) -> EGMLAConfig:
    return EGMLAConfig(**{**base, **overrides})


def tiny_model(seed: int = 0, base: dict = TINY, gate_std: float = 0.2, **overrides) -> EGMLAForCausalLM:
    """A random model whose gate really acts (its zero-initialised up-projection is randomised), as its query norm
    (`qk_norm`)."""
    torch.manual_seed(seed)
    model = EGMLAForCausalLM(tiny_config(base, **overrides)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.self_attn.gate_embedding_proj is not None:
                layer.self_attn.gate_embedding_proj.weight.normal_(std=gate_std)
            if layer.self_attn.key_norm_heads:  # a query norm that is not the identity
                layer.self_attn.q_norm.weight.normal_(mean=1.0, std=0.3)
    return model


def tiny_llama(rope_parameters: dict | None = None, **overrides) -> LlamaForCausalLM:
    """A random GQA Llama (8 query heads, 2 KV heads) to convert."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**tiny_values(rope_parameters, **overrides))).eval()


def tiny_values(rope_parameters: dict | None = None, **overrides) -> dict:
    """The config values of `tiny_llama`'s shape, for any family's config class."""
    values = {
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 128,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_parameters": rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
    }
    values.update(overrides)
    return values


SOURCE_FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "llama-bias": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
}
# A tiny Gemma 3: a windowed layer (with its own RoPE base) and a full one, a window shorter than the tests' inputs,
# an attention scalar other than its head_dim.
GEMMA3 = {
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 24,
    "query_pre_attn_scalar": 24,
    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
}  # fmt: skip


def tiny_source(family: str, rope_parameters: dict | None = None, **overrides) -> PreTrainedModel:
    """A random GQA model of a convertible family, shaped as `tiny_llama`: "llama", "llama-bias" (attention_bias),
    "mistral", "qwen2" (q/k/v biases), "qwen3" (QK-norm) or "gemma3" (`GEMMA3`); biases and norm weights drawn at
    random, not left at their initialization."""
    config_class, model_class = SOURCE_FAMILIES[family]
    family_values = {**{"llama-bias": {"attention_bias": True}, "gemma3": GEMMA3}.get(family, {}), **overrides}
    rope_parameters = family_values.pop("rope_parameters", None) if rope_parameters is None else rope_parameters
    family_values.pop("rope_parameters", None)
    values = tiny_values(rope_parameters, **family_values)
    torch.manual_seed(0)
    model = model_class(config_class(**values)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(std=0.5)
        for layer in model.model.layers:
            for norm in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)):
                if norm is not None:
                    norm.weight.normal_(mean=1.0, std=0.3)
        if family == "gemma3":  # every norm scales by 1 + its weight, which starts at zero
            for name, parameter in model.named_parameters():
                if "norm" in name:
                    parameter.normal_(mean=0.0, std=0.3)
    return model


def needs_shared(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"{path} is absent: the shared assets folder (../shared) is not next to this clone")


def incremental_logits(model, input_ids: torch.Tensor, prefill: int, cache) -> torch.Tensor:
    """Prefill `prefill` tokens, then feed the rest one token at a time."""
    logits = [model(input_ids=input_ids[:, :prefill], cache=cache, use_cache=True).logits]
    for step in range(prefill, input_ids.shape[1]):
        logits.append(model(input_ids=input_ids[:, step : step + 1], cache=cache, use_cache=True).logits)
    return torch.cat(logits, dim=1)


def generate_both(model, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """`generate` with and without the cache."""
    with torch.no_grad():
        cached = model.generate(**kwargs, use_cache=True)
        uncached = model.generate(**kwargs, use_cache=False)
    return cached, uncached


@torch.no_grad()
def assert_same_model(student, teacher, input_ids: torch.Tensor) -> None:
    """A conversion that should be exact: the same logits (fp32, within 1e-4) and the same greedy tokens."""
    torch.testing.assert_close(student(input_ids).logits, teacher(input_ids).logits, rtol=0, atol=1e-4)
    assert torch.equal(
        student.generate(input_ids[:, :10], max_new_tokens=10, do_sample=False),
        teacher.generate(input_ids[:, :10], max_new_tokens=10, do_sample=False),
    )


# ----------------------------------------------------------------------------------------------------------------
# Llama folders for the command-line tests (conversion, bad input, crash safety)
# ----------------------------------------------------------------------------------------------------------------

TOKENIZER = Path(__file__).resolve().parents[1] / "egmla" / "data" / "stories260K-tokenizer"
# `egmla convert` flags that make a tiny conversion take a second: closed form, few short calibration blocks, few
# samples of the source (where they are drawn: no text, or text with a share of samples).
FAST = ["--kv-lora-rank", "16", "--rope-split", "exact", "--reconstruction-steps", "0", "--calibration-blocks", "4",
        "--block-size", "32", "--sampled-blocks", "16", "--held-aside-samples", "3"]  # fmt: skip


# The stories260K tokenizer's size in each family's folder: Qwen2's tokenizer class adds <|endoftext|> (id 512).
TOKENIZER_SIZE = {"llama": 512, "llama-bias": 512, "mistral": 512, "qwen2": 513, "qwen3": 512, "gemma3": 512}


def with_tokenizer(folder: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / name)
    return folder


def llama_folder(folder: Path, **overrides) -> Path:
    """A tiny random Llama saved with the stories260K tokenizer (its vocabulary of 512)."""
    tiny_llama(**{"vocab_size": 512, **overrides}).save_pretrained(folder)
    return with_tokenizer(folder)


def folder_digest(folder: Path) -> str:
    """A hash of every file's name and bytes: equal digests, an untouched folder."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def assert_cache_equals_no_cache(model, shape: tuple[int, int], prefill: int, seed: int) -> None:
    """Logits of random token ids [batch, length], prefilled `prefill` tokens into a fresh EGMLACache then one token a
    step, equal those of a forward without cache."""
    input_ids = torch.randint(3, 128, shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        reference = model(input_ids, use_cache=False).logits
        cached = incremental_logits(model, input_ids, prefill=prefill, cache=EGMLACache(model.config))
    torch.testing.assert_close(cached, reference, rtol=0, atol=1e-5)


def zero_shot_perplexities(
    stories: dict, options: dict, values_per_layer: int | None = None, documents: int | None = None
) -> dict:
    """{name: held-out perplexity} of stories260K converted with each `ConversionOptions` (one calibration shared, no
    fitting), each caching `values_per_layer` values per token per layer where given; `documents`: the first ones of
    the calibration and held-out stories only."""
    from egmla.conversion import calibrate, convert_llama_to_egmla
    from egmla.text import perplexity

    teacher, held_out = stories["teacher"], stories["held_out"][:documents]
    statistics = calibrate(teacher, stories["calibration"][:documents])
    results = {}
    for name, conversion in options.items():
        student = convert_llama_to_egmla(teacher, conversion, statistics)
        if values_per_layer is not None:
            assert student.config.kv_cache_values_per_token() / student.config.num_hidden_layers == values_per_layer
        results[name] = perplexity(student, held_out)
    return results
