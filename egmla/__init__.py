"""egmla: Embedding-Gated Multi-head Latent Attention for Hugging Face transformers.

Importing the package registers `EGMLAConfig` with `AutoConfig` and `EGMLAModel` / `EGMLAForCausalLM` with
`AutoModel` / `AutoModelForCausalLM`. It stays light, as transformers' own model packages are lazy: the model file
(and with it transformers' `modeling_utils`, which imports accelerate) loads when a model class is first used, through
`egmla.EGMLAForCausalLM` or an Auto class. Loading it also registers `attn_implementation="egmla_fused"` (fused decode
kernels, `egmla.kernels`). Saved models carry the two model files and `auto_map` for Hub remote code.
"""

import functools
import importlib
from types import ModuleType

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_egmla import EGMLAConfig
from .lora import LORA_TARGET_MODULES, gate_table_names

__version__ = "0.1.0"

MODELING_NAMES = (
    "EGMLACache",
    "EGMLAForCausalLM",
    "EGMLALatentCacheLayer",
    "EGMLAModel",
    "EGMLAPreTrainedModel",
    "cache_nbytes",
)
AUTO_CLASSES = {AutoModel: "EGMLAModel", AutoModelForCausalLM: "EGMLAForCausalLM"}


@functools.cache  # once: afterwards the Auto mappings hold the real classes
def load_modeling() -> ModuleType:
    """The model file, its kernels registered and its classes put in the Auto mappings in place of the stand-ins."""
    from . import kernels, modeling_egmla  # noqa: F401  (importing egmla.kernels registers the egmla_fused names)

    for auto_class, name in AUTO_CLASSES.items():
        auto_class.register(EGMLAConfig, getattr(modeling_egmla, name), exist_ok=True)
    return modeling_egmla


class LazyModelClass:
    """Holds a model class's place in an Auto mapping until first used, then hands every attribute to the real
    class (`from_pretrained`, `from_config`, ...), so that registering does not import the model file."""

    def __init__(self, name: str) -> None:
        self.__name__ = name
        self.config_class = EGMLAConfig  # what `AutoModel.register` checks, answered without loading

    def __getattr__(self, attribute: str):
        return getattr(getattr(load_modeling(), self.__name__), attribute)

    def __repr__(self) -> str:
        return f"<egmla.{self.__name__}, loaded when used>"


def __getattr__(name: str):
    """`egmla.EGMLAForCausalLM` and the other model names (PEP 562), and the subpackages, loaded on first use."""
    if name in MODELING_NAMES:
        return getattr(load_modeling(), name)
    if name in ("kernels", "conversion", "modeling_egmla"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


AutoConfig.register(EGMLAConfig.model_type, EGMLAConfig, exist_ok=True)
EGMLAConfig.register_for_auto_class()
for auto_class, name in AUTO_CLASSES.items():
    auto_class.register(EGMLAConfig, LazyModelClass(name), exist_ok=True)


__all__ = ["EGMLAConfig", "LORA_TARGET_MODULES", "gate_table_names", *MODELING_NAMES]
