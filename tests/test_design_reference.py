"""The attention layer against an independent, literal transcription of the design note's equations (section 2)."""

import math

import pytest
import torch

from tests.utils import tiny_model


def rms(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta=10000.0):
    """x [heads, T, d] rotated in the half-split layout."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions[:, None].float() * inv_freq
    emb = torch.cat([angles, angles], -1)
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return x * emb.cos() + torch.cat([-second, first], -1) * emb.sin()


def reference_attention(model, layer_idx, x, token_ids):
    """o_{t,i} = softmax_j(q_{t,i} . k_{j,i} * scale) z^V_{j,i}, y_t = W^O [o_{t,1}; ...]; x [T, D]."""
    config, attention = model.config, model.model.layers[layer_idx].self_attn
    heads, dn, dr, dv = config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    rank, rope_heads, length = config.kv_lora_rank, config.rope_key_heads, x.shape[0]
    positions = torch.arange(length)

    if config.q_lora_rank is None:
        q = attention.q_proj(x)
    else:
        q = attention.q_b_proj(rms(attention.q_a_proj(x), attention.q_a_layernorm.weight))
    q = q.view(length, heads, dn + dr)
    q_content, q_rope = q[..., :dn], rope(q[..., dn:].transpose(0, 1), positions).transpose(0, 1)

    c_and_kr = attention.kv_a_proj_with_mqa(x)  # [c_t ; kr_t] = W^{DKV} h_t
    c, kr = c_and_kr[:, :rank], c_and_kr[:, rank:]
    if config.kv_latent_norm:
        c = rms(c, attention.kv_a_layernorm.weight)
    k_rope = rope(kr.view(length, rope_heads, dr).transpose(0, 1), positions).transpose(0, 1)  # [T, Hr, dr]

    e = model.model.gate_embeddings[layer_idx // config.gate_layers_per_table](token_ids)  # e_t = E[x_t]
    g = 1 + e @ attention.gate_embedding_proj.weight.T  # g_t = 1 + W^{UE} e_t
    if config.gate_position == "latent":
        c = c * g
        if config.gate_norm == "rms":
            c = rms(c, attention.gate_norm.weight)
    u = c @ attention.kv_b_proj.weight.T  # u_t = W^{UKV} c_t
    if config.gate_position == "kv":
        u = u * g
    z = u.view(length, heads, dn + dv)
    if config.gate_position == "kv" and config.gate_norm == "rms":
        z = rms(z, attention.gate_norm.weight)  # per-head GateNorm

    outputs = []
    causal = torch.ones(length, length).triu(1).bool()
    for head in range(heads):
        key = torch.cat([z[:, head, :dn], k_rope[:, head // (heads // rope_heads)]], -1)
        query = torch.cat([q_content[:, head], q_rope[:, head]], -1)
        scores = (query @ key.T / math.sqrt(dn + dr)).masked_fill(causal, float("-inf"))
        outputs.append(scores.softmax(-1) @ z[:, head, dn:])
    return attention.o_proj(torch.cat(outputs, -1))


@pytest.mark.parametrize("gate_position", ["kv", "latent"])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"rope_key_heads": 2, "q_lora_rank": 24}, {"gate_norm": "none", "kv_latent_norm": False}],
    ids=["default", "rope-groups+q-lora", "no-norms"],
)
def test_attention_matches_the_design_note(gate_position, overrides):
    model = tiny_model(gate_position=gate_position, gate_layers_per_table=2, **overrides)
    token_ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    captured = {}
    attention = model.model.layers[1].self_attn
    hook = attention.register_forward_hook(
        lambda module, args, kwargs, out: captured.update(x=args[0][0], y=out[0][0]), with_kwargs=True
    )
    with torch.no_grad():
        model(token_ids, use_cache=False)
        hook.remove()
        expected = reference_attention(model, 1, captured["x"], token_ids[0])
    torch.testing.assert_close(expected, captured["y"], rtol=0, atol=1e-5)
    # The check is sensitive to the gate: a 10% larger W^{UE} moves the output.
    with torch.no_grad():
        attention.gate_embedding_proj.weight.mul_(1.1)
        assert (reference_attention(model, 1, captured["x"], token_ids[0]) - captured["y"]).abs().max() > 1e-4
