"""egmla: Embedding-Gated Multi-head Latent Attention for Hugging Face transformers.

Importing the package registers `EGMLAConfig`, `EGMLAModel` and `EGMLAForCausalLM` with the Auto classes, and
marks them for Hub remote code, so `save_pretrained` writes the two model files and `auto_map` next to the weights.
It also registers `attn_implementation="egmla_fused"` (fused decode kernels, `egmla.kernels`).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from . import kernels
from .configuration_egmla import EGMLAConfig
from .lora import LORA_TARGET_MODULES, gate_table_names
from .modeling_egmla import (
    EGMLACache,
    EGMLAForCausalLM,
    EGMLALatentCacheLayer,
    EGMLAModel,
    EGMLAPreTrainedModel,
    cache_nbytes,
)

__version__ = "0.1.0"

AutoConfig.register(EGMLAConfig.model_type, EGMLAConfig, exist_ok=True)
AutoModel.register(EGMLAConfig, EGMLAModel, exist_ok=True)
AutoModelForCausalLM.register(EGMLAConfig, EGMLAForCausalLM, exist_ok=True)
EGMLAConfig.register_for_auto_class()
EGMLAModel.register_for_auto_class("AutoModel")
EGMLAForCausalLM.register_for_auto_class("AutoModelForCausalLM")
kernels.register()


__all__ = [
    "EGMLACache",
    "EGMLAConfig",
    "EGMLAForCausalLM",
    "EGMLALatentCacheLayer",
    "EGMLAModel",
    "EGMLAPreTrainedModel",
    "LORA_TARGET_MODULES",
    "cache_nbytes",
    "gate_table_names",
]
