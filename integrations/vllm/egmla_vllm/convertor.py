"""How vLLM reads an egmla config's architecture: MLA (one KV head, a latent cache row per token per layer)."""

from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

from .config import check_servable


class EGMLAArchConfigConvertor(ModelArchConfigConvertorBase):
    def is_deepseek_mla(self) -> bool:
        return True

    def get_head_size(self) -> int:
        """The cached row: the widest layer's latent (narrower ones are zero-padded), every rope key, and with the
        gate on K/V the token id."""
        config = self.hf_text_config
        check_servable(config)  # refused before vLLM sizes a cache for what it cannot serve
        return config.cache_row_width

    def get_total_num_kv_heads(self) -> int:
        return 1
