"""Run by the vLLM venv's python (`test_vllm_plugin.py`): `AbsorbedAttention` against the source's expanded attention
computed from the same latents and rope keys, in fp32 (SDPA, the plugin's decode kernel) and bf16 (vLLM's CPU latent
kernels, the row padded from 28 to 32 values, the values' width 12 padded to 32): decodes beside prompts (the prompts
expanded), prompts after cached context (absorbed over the paged cache, whose other slots hold NaN), prompts of one
length. Prints OK at its end."""

from types import SimpleNamespace

import torch
from egmla_vllm.attention import AbsorbedAttention, latent_kernels

torch.manual_seed(0)
HEADS, NOPE, ROPE, LATENT, VALUE, BLOCK, SCALE = 4, 8, 8, 20, 12, 16, 0.3
UP = torch.randn(HEADS * (NOPE + VALUE), LATENT) / 4  # W^{UKV}, per query head


class Projection:
    """W^{UKV} as vLLM's linear layers call: (output, bias)."""

    weight = UP

    def __call__(self, x):
        return x @ self.weight.T.to(x.dtype), None


class Layer(SimpleNamespace):
    """AbsorbedAttention's methods over plain attributes (no vLLM config needed)."""


for method in ("process_weights_after_loading", "forward_impl", "absorb", "up_value", "expanded_prefill", "prompt_keys",
               "decode", "absorbed_prefill"):  # fmt: skip
    setattr(Layer, method, getattr(AbsorbedAttention, method))


def reference(query, rows, length):
    """The expanded attention, in fp32, of the new token at position length - 1 over its request's rows [length, D]."""
    latent, rope_key = rows[:length, :LATENT].float(), rows[:length, LATENT : LATENT + ROPE].float()
    keys_values = (latent @ UP.T).view(length, HEADS, NOPE + VALUE)
    keys = torch.cat([keys_values[..., :NOPE], rope_key[:, None].expand(-1, HEADS, -1)], dim=-1)
    weights = torch.softmax(torch.einsum("hd,thd->ht", query[:, : NOPE + ROPE].float(), keys) * SCALE, dim=-1)
    return torch.einsum("ht,thv->hv", weights, keys_values[..., NOPE:])


def metadata_for(blocks, seq_lens, query_lens, decodes, cached):
    """What vLLM's MLA metadata builders (with the AMX builder's fields) hand the layer."""
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(query_lens).cumsum(0)])
    flat = (blocks.long()[:, :, None] * BLOCK + torch.arange(BLOCK)).flatten(1)  # each request's slots
    decode = SimpleNamespace(
        block_table=blocks[:decodes], seq_lens=seq_lens[:decodes].int(), req_to_token=flat[:decodes].int(),
        req_pool_indices=torch.arange(decodes), seq_lens_i64=seq_lens[:decodes], num_kv_splits=2,
    )  # fmt: skip
    prefill_starts = starts[decodes:] - starts[decodes]
    prefill = SimpleNamespace(
        query_start_loc=prefill_starts.int(), chunked_context=object() if any(cached[decodes:]) else None,
        cpu_seq_lens=seq_lens[decodes:], req_to_token=flat[decodes:], req_pool_indices=torch.arange(len(seq_lens) - decodes),
        extend_seq_lens=prefill_starts[1:] - prefill_starts[:-1], extend_start_loc=prefill_starts[:-1],
        max_len_extend=max(query_lens[decodes:], default=0),
    )  # fmt: skip
    return SimpleNamespace(
        num_actual_tokens=sum(query_lens), num_decode_tokens=decodes, num_decodes=decodes, decode=decode,
        prefill=prefill, request_block_table=blocks, request_seq_lens=seq_lens.int(), request_query_start_loc=starts.int(),
    ), starts  # fmt: skip


def check(kernels, dtype, cached, query_lens, decodes):
    """Requests with `cached` tokens in the cache and `query_lens` new ones each (the first `decodes`: one)."""
    tail = ROPE + (-(LATENT + ROPE) % 32 if kernels else 0)  # the rope key, then zero columns
    layer = Layer(
        num_heads=HEADS, qk_nope_head_dim=NOPE, v_head_dim=VALUE, kv_lora_rank=LATENT, rope_key_width=ROPE,
        kernels=kernels, value_width=32 if kernels else LATENT, scale=SCALE, kv_b_proj=Projection(),
    )  # fmt: skip
    layer.process_weights_after_loading(dtype)
    seq_lens = torch.tensor(cached) + torch.tensor(query_lens)
    blocks = torch.randperm(40)[: 4 * len(cached)].view(len(cached), 4).to(torch.int32)
    cache = torch.full((40, BLOCK, LATENT + tail), float("nan"), dtype=dtype)
    rows, queries = [], []
    for request, length in enumerate(seq_lens.tolist()):
        rows.append(torch.cat([torch.randn(length, LATENT + ROPE), torch.zeros(length, tail - ROPE)], -1).to(dtype))
        for position in range(length):  # written by the cache update before the attention runs
            cache[blocks[request, position // BLOCK], position % BLOCK] = rows[-1][position]
        new = query_lens[request]
        queries.append(torch.cat([torch.randn(new, HEADS, NOPE + ROPE), torch.zeros(new, HEADS, tail - ROPE)], -1))
    metadata, starts = metadata_for(blocks, seq_lens, query_lens, decodes, cached)
    new_rows = torch.cat([own[length:] for own, length in zip(rows, cached, strict=True)])
    output = torch.full((sum(query_lens) + 3, HEADS * VALUE), float("nan"), dtype=dtype)  # 3 padding tokens
    query = torch.cat(queries).to(dtype)
    layer.forward_impl(query, new_rows[:, :LATENT], new_rows[:, None, LATENT:], cache, metadata, output)
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4
    for request, (length, new) in enumerate(zip(cached, query_lens, strict=True)):
        for offset in range(new):
            expected = reference(query[starts[request] + offset], rows[request], length + offset + 1)
            attended = output[starts[request] + offset].view(HEADS, VALUE).float()
            torch.testing.assert_close(attended, expected, rtol=tolerance, atol=tolerance)


assert latent_kernels(torch.bfloat16), "vLLM's CPU latent kernels are missing from this vLLM build"
for kernels, dtype in ((False, torch.float32), (True, torch.bfloat16)):
    check(kernels, dtype, cached=[20, 40, 0, 0], query_lens=[1, 1, 7, 5], decodes=2)  # decodes beside prompts
    check(kernels, dtype, cached=[30, 17], query_lens=[6, 3], decodes=0)  # prompts after cached context
    check(kernels, dtype, cached=[0, 0], query_lens=[9, 9], decodes=0)  # prompts of one length
print("OK")
