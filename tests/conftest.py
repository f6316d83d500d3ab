"""Shared fixtures: tiny random EG-MLA configs and the real assets in ../shared (skipped when absent)."""

import os
from pathlib import Path

# Triton kernels run in Triton's CPU interpreter here; it must be chosen before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import egmla  # noqa: F401  (registers the Auto classes)
from egmla import EGMLAConfig, EGMLAForCausalLM

torch.set_num_threads(1)  # tiny models on a shared 2-core machine: threads only add noise

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
STORIES260K = SHARED / "assets" / "stories260K-hf"
TINYSTORIES = SHARED / "assets" / "text" / "tinystories_train_2MiB.txt"

# The three cache modes of the issue: gate off (plain MLA), gate on the up-projected K/V, gate on the latent.
MODES = {
    "mla": {"gate_embedding_dim": 0, "gate_position": "kv"},
    "mla-absorbed": {"gate_embedding_dim": 0, "gate_position": "latent"},
    "gate-kv": {"gate_embedding_dim": 16, "gate_position": "kv"},
    "gate-latent": {"gate_embedding_dim": 16, "gate_position": "latent"},
}


def tiny_config(**overrides) -> EGMLAConfig:
    values = {
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
    values.update(overrides)
    return EGMLAConfig(**values)


def tiny_model(seed: int = 0, **overrides) -> EGMLAForCausalLM:
    """A random model whose gate really acts (its zero-initialised up-projection is randomised)."""
    torch.manual_seed(seed)
    model = EGMLAForCausalLM(tiny_config(**overrides)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.self_attn.gate_embedding_proj is not None:
                layer.self_attn.gate_embedding_proj.weight.normal_(std=0.2)
    return model


def needs_shared(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"{path} is absent: the shared assets folder (../shared) is not next to this clone")
