"""The models the paper compares, at its width (or a toy width for --quick): a Llama with full multi-head K/V,
MLA-Base (EG-MLA with the gate off), EG-MLA-kv64 / kv16, and transformers' own DeepSeek-V3 MLA."""

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from ..configuration_egmla import PRESETS, EGMLAConfig
from ..modeling_egmla import EGMLAForCausalLM

NAMES = ("mha", "mla-base", "egmla-kv64", "egmla-kv64-latent", "egmla-kv16", "deepseek-v3-mla")
LABELS = {
    "mha": "MHA (Llama)",
    "mla-base": "MLA-Base",
    "egmla-kv64": "EG-MLA-kv64",
    "egmla-kv64-latent": "EG-MLA-kv64, gate on the latent",
    "egmla-kv16": "EG-MLA-kv16",
    "deepseek-v3-mla": "DeepSeek-V3 MLA (transformers)",
}


def paper_dims(layers: int | None = None, vocab_size: int | None = None) -> dict:
    """The paper's shared dims (`paper-mla-base`), optionally with fewer layers or a smaller vocabulary."""
    dims = dict(PRESETS["paper-mla-base"])
    if layers is not None:
        dims["num_hidden_layers"] = layers
    if vocab_size is not None:
        dims.update(vocab_size=vocab_size, bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)
    return dims


def build(name: str, dims: dict, max_positions: int = 2048) -> torch.nn.Module:
    """One of NAMES, randomly initialized (seeded), in eval mode."""
    torch.manual_seed(0)
    common = {
        "vocab_size": dims["vocab_size"],
        "hidden_size": dims["hidden_size"],
        "intermediate_size": dims["intermediate_size"],
        "num_hidden_layers": dims["num_hidden_layers"],
        "num_attention_heads": dims["num_attention_heads"],
        "max_position_embeddings": max_positions,
        "bos_token_id": dims["bos_token_id"],
        "eos_token_id": dims["eos_token_id"],
    }
    if name == "mha":
        # The paper's MHA: every head caches a key and a value of hidden_size / heads (64) values each.
        model = LlamaForCausalLM(LlamaConfig(**common, num_key_value_heads=dims["num_attention_heads"]))
    elif name == "deepseek-v3-mla":
        model = DeepseekV3ForCausalLM(
            DeepseekV3Config(
                **common,
                q_lora_rank=None,
                kv_lora_rank=PRESETS["paper-mla-base"]["kv_lora_rank"],
                qk_nope_head_dim=dims["qk_nope_head_dim"],
                qk_rope_head_dim=dims["qk_rope_head_dim"],
                v_head_dim=dims["v_head_dim"],
                first_k_dense_replace=dims["num_hidden_layers"],  # dense layers only
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_group=1,
                topk_group=1,
                rope_interleave=False,
            )
        )
    else:
        preset = {"mla-base": "paper-mla-base", "egmla-kv64": "paper-egmla-kv64", "egmla-kv16": "paper-egmla-kv16"}
        overrides = {key: dims[key] for key in ("vocab_size", "num_hidden_layers", "bos_token_id", "eos_token_id")}
        if name == "egmla-kv64-latent":
            name, overrides["gate_position"] = "egmla-kv64", "latent"
        model = EGMLAForCausalLM(
            EGMLAConfig.from_preset(preset[name], **overrides, max_position_embeddings=max_positions)
        )
    return model.eval()
