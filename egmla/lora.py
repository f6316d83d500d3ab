"""What PEFT needs to know about EG-MLA, which is not in its table of known models (no import of peft here, so that
`import egmla` stays light)."""

from .configuration_egmla import EGMLAConfig

# Module names for PEFT's `target_modules`: every linear layer of attention and MLP.
LORA_TARGET_MODULES = [
    "q_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "o_proj",
    "gate_embedding_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
]


def gate_table_names(config: EGMLAConfig) -> list[str]:
    """Module names of the gate tables, for PEFT's `modules_to_save` (train the tables alongside LoRA)."""
    return [f"gate_embeddings.{index}" for index in range(config.num_gate_tables)]
