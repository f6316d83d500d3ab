"""Cache sizes read off the cache objects of real `generate` calls (never computed from a config)."""

import torch
from transformers import Cache

from .modeling_egmla import cache_nbytes


@torch.no_grad()
def cache_after_generate(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> tuple[Cache, int]:
    """Greedy-generates `new_tokens` after `prompt` [B, S]; returns the cache and how many tokens it holds
    (B * (S + new_tokens - 1): the last sampled token never enters the cache)."""
    prompt = prompt.to(model.device)
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


def per_token_bytes(cache: Cache, name: str) -> int:
    """Bytes of the per-token values `name` ("token_ids", "positions") the cache's layers hold."""
    tensors = [getattr(layer, name, None) for layer in cache.layers]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def kv_values_per_token(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int = 8) -> dict:
    """K/V values per token per layer (token ids and positions excluded), and their bytes per token."""
    cache, tokens = cache_after_generate(model, prompt, new_tokens)
    ids_bytes, position_bytes = per_token_bytes(cache, "token_ids"), per_token_bytes(cache, "positions")
    itemsize = cache.layers[0].keys.element_size()
    values = (cache_nbytes(cache) - ids_bytes - position_bytes) / itemsize / tokens / len(cache.layers)
    return {
        "values_per_token_per_layer": values,
        "token_id_bytes_per_token": ids_bytes / tokens,
        "position_bytes_per_token": position_bytes / tokens,
    }


def parameter_bytes_by_device(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of parameters on each device: the accelerator's share leaves out offloaded gate tables."""
    sizes: dict[str, int] = {}
    for parameter in model.parameters():
        device = str(parameter.device)
        sizes[device] = sizes.get(device, 0) + parameter.numel() * parameter.element_size()
    return sizes
