"""Cache sizes read off the cache objects of real `generate` calls (never computed from a config)."""

import torch
from transformers import Cache

from .modeling_egmla import cache_nbytes


@torch.no_grad()
def cache_after_generate(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> tuple[Cache, int]:
    """Greedy-generates `new_tokens` after `prompt` [B, S]; returns the cache and how many tokens it holds
    (B * (S + new_tokens - 1): the last sampled token never enters the cache)."""
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
    )
    return out.cache, prompt.shape[0] * out.cache.get_seq_length()


def cache_bytes_per_token(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> float:
    """Bytes per token (all layers) of every tensor the cache holds, token ids included."""
    cache, tokens = cache_after_generate(model, prompt, new_tokens)
    return cache_nbytes(cache) / tokens


def kv_values_per_token(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int = 8) -> dict:
    """K/V values per token per layer (token ids excluded), and the bytes of token ids per token."""
    cache, tokens = cache_after_generate(model, prompt, new_tokens)
    ids = [getattr(layer, "token_ids", None) for layer in cache.layers]
    ids_bytes = sum(t.numel() * t.element_size() for t in ids if t is not None)
    itemsize = cache.layers[0].keys.element_size()
    values = (cache_nbytes(cache) - ids_bytes) / itemsize / tokens / len(cache.layers)
    return {"values_per_token_per_layer": values, "token_id_bytes_per_token": ids_bytes / tokens}


def parameter_bytes_by_device(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of parameters on each device: the accelerator's share leaves out offloaded gate tables."""
    sizes: dict[str, int] = {}
    for parameter in model.parameters():
        device = str(parameter.device)
        sizes[device] = sizes.get(device, 0) + parameter.numel() * parameter.element_size()
    return sizes
