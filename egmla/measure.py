"""Cache sizes read off the cache objects of real `generate` calls (never computed from a config), and decode steps
timed over filled caches."""

import statistics
import time
from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache, StaticCache

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


@torch.no_grad()
def filled_cache(model: torch.nn.Module, cache_kind: str, batch_size: int, context: int, seed: int):
    """A cache holding `context` random positions per layer (a windowed layer the last `window - 1` of them), shaped
    as the model's own (learned from a 2-token forward), with random token ids where the model keeps them. It
    records its past, so that `DecodeState.step`'s `crop(-1)` rolls every layer back."""
    device = model.device  # drawn where the cache lives: an accelerator's caches can exceed the host's memory
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, min(100, model.config.vocab_size), (batch_size, 2), generator=generator, device=device)
    probe = model(ids, use_cache=True).cache
    if cache_kind == "static":
        cache = StaticCache(config=model.config, max_cache_len=context + 8)
    else:
        cache = DynamicCache(config=model.config)
    if not all(getattr(layer, "is_croppable", True) for layer in cache.layers):
        raise ValueError(
            f"{type(model).__name__}'s {cache_kind} cache drops positions past its windows, so a timed step cannot be "
            "undone: time it with a dynamic cache."
        )
    cache.activate_past_recording()
    per_token = getattr(cache.layers[0], "append_per_token", None)
    if per_token is not None and probe.layers[0].token_ids is not None:
        ids = torch.randint(0, model.config.vocab_size, (batch_size, context), generator=generator, device=device)
        per_token("token_ids", ids)
    if per_token is not None and probe.layers[0].positions is not None:  # rebuilt keys turn by their positions
        per_token("positions", torch.arange(context, device=device).expand(batch_size, context))
    for layer_idx, layer in enumerate(probe.layers):
        keys, values = (
            torch.randn(*part.shape[:2], context, part.shape[-1], generator=generator, device=device, dtype=part.dtype)
            for part in (layer.keys, layer.values)
        )
        window = getattr(layer, "sliding_window", None)
        cache.update(keys, values, layer_idx, **({"sliding_window": window} if window else {}))
        if window:  # back to its window at once, not after every layer has held the whole context
            cache.layers[layer_idx].crop(0)
    return cache


@dataclass
class DecodeState:
    """A model, its filled cache and the forward to time; `step()` decodes one token at the context's end and crops
    the cache back, so every timed step sees the same context. The cache records its past
    (`activate_past_recording`, before it is filled), so that `crop` rolls windowed layers back too."""

    forward: object
    cache: object
    token: torch.Tensor
    position: torch.Tensor

    def step(self) -> None:
        self.forward(self.token, cache=self.cache, position_ids=self.position, use_cache=True)
        self.cache.crop(-1)


def decode_state(model: torch.nn.Module, cache_kind: str, batch_size: int, context: int) -> DecodeState:
    cache = filled_cache(model, cache_kind, batch_size, context, seed=context + batch_size)
    forward = torch.compile(model.forward, dynamic=False) if cache_kind == "static" else model.forward
    token = torch.randint(0, model.config.vocab_size, (batch_size, 1), generator=torch.Generator().manual_seed(1))
    return DecodeState(
        forward, cache, token.to(model.device), torch.full((batch_size, 1), context, device=model.device)
    )


def median_ms(states: dict[str, DecodeState], repetitions: int, steps: int) -> dict[str, float]:
    """Interleaved: every repetition times each model in turn (the machine is shared and noisy)."""
    for state in states.values():
        for _ in range(2):  # warm-up: compiles the static graphs (and the fused paths), first allocations
            state.step()
    samples = {name: [] for name in states}
    for _ in range(repetitions):
        for name, state in states.items():
            started = time.perf_counter()
            for _ in range(steps):
                state.step()
            if state.token.device.type != "cpu":  # an accelerator runs ahead of the host: wait for its steps
                torch.accelerator.synchronize(state.token.device)
            samples[name].append((time.perf_counter() - started) * 1000 / steps)
    return {name: statistics.median(values) for name, values in samples.items()}
