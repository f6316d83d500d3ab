"""The fused decode computations in plain torch, shaped for `torch.compile` (the CPU fast path).

Both functions take what the cache holds and the layer's weights, never the expanded K/V of the reference path:
compiled, the expansion, the gate, its norm and the attention fuse into a few loops over the cached positions.
"""

import torch

from .interface import KVDecodeInputs, KVDecodeWeights, LatentDecodeInputs


def decode_kv(inputs: KVDecodeInputs, weights: KVDecodeWeights) -> torch.Tensor:
    """Attention of new queries over a latent cache with the gate on the per-head keys and values
    (`interface.KVDecodeInputs` / `KVDecodeWeights` give the shapes). Returns [B, S, H, dv].

    Keys (and values) are rebuilt once per key head; its group of query heads attends as rows of one product. The
    gate depends on the token only: its product is computed once per gate row (one per distinct cached token when
    `gate_index` is given) and gathered per position.
    """
    query, latent, rope_key, gate_rows, gate_index, key_cos, key_sin, mask, key_scale = inputs
    kv_weight, gate_weight, norm_weight, norm_eps, scaling, nope_dim, rope_key_heads, absorb_values = weights
    batch_size, heads, query_length, qk_dim = query.shape
    key_length, key_heads = latent.shape[1], kv_weight.shape[0]
    rebuilt = kv_weight[:, : qk_dim if key_cos is not None else nope_dim] if absorb_values else kv_weight
    kv = torch.matmul(latent, rebuilt.flatten(0, 1).t()).view(batch_size, key_length, key_heads, -1)  # [B,T,Hkv,C]
    if gate_weight is not None:
        gate = torch.matmul(gate_rows, gate_weight.flatten(0, 1).t()).view(-1, key_heads, kv.shape[-1])  # [U,Hkv,C]
        gate = gate.view(batch_size, key_length, key_heads, -1) if gate_index is None else gate[gate_index]
        kv = kv * (1 + gate)
    if norm_weight is not None:
        variance = kv.float().pow(2).mean(-1, keepdim=True)
        kv = norm_weight * (kv.float() * torch.rsqrt(variance + norm_eps)).to(kv.dtype)
    kv = kv.transpose(1, 2)  # [B, Hkv, T, C]
    rows = query.reshape(batch_size, key_heads, heads // key_heads * query_length, qk_dim)  # [B, Hkv, M, dq]
    if key_cos is not None:  # "exact" rope: the rope dims of every rebuilt key turn with its cached position
        key_nope, key_rope, value = kv.split([nope_dim, qk_dim - nope_dim, kv.shape[-1] - qk_dim], dim=-1)
        half = key_rope.shape[-1] // 2
        turned = torch.cat([-key_rope[..., half:], key_rope[..., :half]], dim=-1)
        key_rope = key_rope * key_cos[:, None] + turned * key_sin[:, None]
        scores = torch.matmul(rows, torch.cat([key_nope, key_rope], dim=-1).transpose(2, 3))  # [B, Hkv, M, T]
    else:
        key_nope, value = kv[..., :nope_dim], kv[..., nope_dim:]
        query_rope = query[..., nope_dim:]
        rope_dim = query_rope.shape[-1]
        scores = torch.matmul(rows[..., :nope_dim], key_nope.transpose(2, 3))  # [B, Hkv, M, T]
        # Each rope key serves a group of heads: [B, Hr, G, S, dr] x [B, Hr, 1, dr, T], no copy per head.
        query_rope = query_rope.reshape(batch_size, rope_key_heads, heads // rope_key_heads, query_length, rope_dim)
        rope_key = rope_key.view(batch_size, key_length, rope_key_heads, rope_dim).permute(0, 2, 3, 1).unsqueeze(2)
        scores = scores + torch.matmul(query_rope, rope_key).view(scores.shape)
    scores = scores.float().view(batch_size, heads, query_length, key_length) * scaling
    if key_scale is not None:  # qk_norm: every score of a key times its norm's scale
        scores = scores * key_scale[:, :, None]
    scores = scores.masked_fill(~mask[:, None], float("-inf")).view(batch_size, key_heads, -1, key_length)
    if absorb_values:  # every head's weights over the shared latents [B, Hkv, M, r], then W^{UV} per key head
        out_latent = torch.matmul(torch.softmax(scores, dim=-1).to(latent.dtype), latent[:, None])
        output = torch.einsum("bgmr,gvr->bgmv", out_latent, kv_weight[:, rebuilt.shape[1] :])
    else:
        output = torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)  # [B, Hkv, M, dv]
    return output.reshape(batch_size, heads, query_length, -1).transpose(1, 2)


def decode_latent(inputs: LatentDecodeInputs, scaling: float) -> torch.Tensor:
    """The absorbed MQA: every head attends over the shared [latent ; rope key] and reads back the latent
    (`interface.LatentDecodeInputs` gives the shapes). Returns the attended latent [B, H, S, r]."""
    query_latent, query_rope, latent, rope_key, mask, key_scale = inputs
    batch_size, heads, query_length, _ = query_latent.shape
    # One KV head: the query heads fold into the rows of batched products over [B, H*S, .], no copy per head.
    scores = torch.bmm(query_latent.reshape(batch_size, heads * query_length, -1), latent.transpose(1, 2))
    scores = scores + torch.bmm(query_rope.reshape(batch_size, heads * query_length, -1), rope_key.transpose(1, 2))
    scores = scores.view(batch_size, heads, query_length, -1)  # [B, H, S, T]
    scores = scores.float() * scaling
    if key_scale is not None:  # qk_norm: every score of a key times its norm's scale
        scores = scores * key_scale[:, :, None]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(latent.dtype)
    return torch.bmm(probs.view(batch_size, heads * query_length, -1), latent).view(batch_size, heads, query_length, -1)
