"""Partial RoPE: which parts of the source's keys keep rotating in the cached rope key, and which become NoPE
dims that the latent rebuilds. Either MHA2MLA's per-KV-head rope keys, or TransMLA's RoRoPE: one rope key shared
by all heads, made of the principal components of the KV heads' keys per frequency."""

from dataclasses import dataclass

import torch
from transformers import LlamaForCausalLM

from . import families
from .calibration import LayerStatistics

PAIR_SELECTIONS = ("rotation", "norm")


def rotation_variance(inv_freq: torch.Tensor, context_length: int) -> torch.Tensor:
    """Per rotary pair, 1 - |E[exp(i theta d)]|^2 over query-key distances d uniform in [0, context_length): how
    much its rotation varies across the distances it must serve (about 0 for a pair that barely turns)."""
    angles = inv_freq.double()[:, None] * torch.arange(context_length, dtype=torch.float64)[None, :]
    return (1 - angles.cos().mean(-1).square() - angles.sin().mean(-1).square()).float()


def select_rope_pairs(
    statistics: LayerStatistics, inv_freq: torch.Tensor, pairs_per_head: int, selection: str = "rotation"
) -> list[list[int]]:
    """Per KV head, the `pairs_per_head` rotary pairs whose removal would cost most, in increasing index.

    MHA2MLA ranks pairs by their q.k contribution (2-norms of the query and key pairs; `selection="norm"`). A pair
    whose angle barely changes over the context loses little when it stops rotating, however large it is, so
    `"rotation"` weights the contribution by the variance of the pair's rotation over the context.
    """
    key_heads = statistics.key_pair_norms.shape[0]
    group = statistics.query_pair_norms.shape[0] // key_heads
    query = statistics.query_pair_norms.view(key_heads, group, -1).sum(dim=1)  # [Hkv, hd/2]
    scores = query * statistics.key_pair_norms
    if selection == "rotation":
        scores = scores * rotation_variance(inv_freq, statistics.context_length)
    return [sorted(head.topk(pairs_per_head).indices.tolist()) for head in scores]


def rope_and_nope_dims(kept_pairs: list[int], head_dim: int) -> tuple[list[int], list[int]]:
    """Dims of one head that keep RoPE (half-split layout of the kept pairs) and those that become NoPE."""
    half = head_dim // 2
    dropped = [pair for pair in range(half) if pair not in kept_pairs]
    rope = kept_pairs + [pair + half for pair in kept_pairs]
    nope = dropped + [pair + half for pair in dropped]
    return rope, nope


@dataclass
class RopeSplit:
    """One layer's query and key projections split into the cached rope part and the NoPE part the latent
    rebuilds, so that per query head: nope_query . nope_key + rope_query . rope_key = the source's q . k."""

    frequencies: list[list[int]]  # [rope key head][pair]: the source frequency each rope pair turns at
    rope_key: torch.Tensor  # [Hr * dr, D] float64, per rope key head its half-split rows
    rope_query: torch.Tensor  # [Hq, dr, D]
    nope_key: torch.Tensor  # [Hkv, dn, D]
    nope_query: torch.Tensor  # [Hq, dn, D]


def split_per_head(query: torch.Tensor, key: torch.Tensor, kept_pairs: list[list[int]]) -> RopeSplit:
    """MHA2MLA's partial RoPE: query [Hq, hd, D], key [Hkv, hd, D]; KV head g keeps the pairs kept_pairs[g] as its
    own rope key, its other dims become NoPE."""
    key_heads, head_dim = key.shape[0], key.shape[1]
    group = query.shape[0] // key_heads
    dims = [rope_and_nope_dims(pairs, head_dim) for pairs in kept_pairs]
    return RopeSplit(
        frequencies=kept_pairs,
        rope_key=torch.cat([key[g, dims[g][0]] for g in range(key_heads)]),
        rope_query=torch.stack([query[h, dims[h // group][0]] for h in range(len(query))]),
        nope_key=torch.stack([key[g, dims[g][1]] for g in range(key_heads)]),
        nope_query=torch.stack([query[h, dims[h // group][1]] for h in range(len(query))]),
    )


def as_complex(rows: torch.Tensor) -> torch.Tensor:
    """[heads, hd, D] half-split rows -> [heads, hd/2, D] complex: pair j is dims j (real) and j + hd/2 (imag),
    so RoPE multiplies pair j by exp(i theta_j t) and a pair's q.k is Re(q conj(k))."""
    half = rows.shape[1] // 2
    return torch.complex(rows[:, :half], rows[:, half:])


def as_half_split(pairs: torch.Tensor) -> torch.Tensor:
    """[..., n, D] complex -> [..., 2n, D] real, half-split."""
    return torch.cat([pairs.real, pairs.imag], dim=-2)


def split_shared(
    query: torch.Tensor,
    key: torch.Tensor,
    statistics: LayerStatistics,
    inv_freq: torch.Tensor,
    pairs: int,
    selection: str = "rotation",
) -> RopeSplit:
    """TransMLA's RoRoPE: one rope key shared by every head. At one frequency every KV head's pair turns by the same
    angle, so RoPE commutes with any complex unitary mixing of the heads there: per frequency, the principal
    components of the KV heads' keys (complex PCA under the calibration covariance) are rotated out exactly; the
    `pairs` (frequency, component) pairs of largest energy, times their rotation variance for `"rotation"`, become
    the shared rope key, and what remains of every head's key becomes NoPE. Each query head gets rope rows for the
    kept components (its pair times its KV head's mixing coefficient), and keeps its full query as NoPE rows."""
    key_heads, head_dim = key.shape[0], key.shape[1]
    group = query.shape[0] // key_heads
    keys, queries = as_complex(key), as_complex(query)  # [Hkv, hd/2, D], [Hq, hd/2, D]
    covariance = statistics.covariance.double()
    # The keys times the (real) covariance at every frequency in one product, [Hkv, hd/2, D].
    weighted = torch.complex(keys.real @ covariance, keys.imag @ covariance)
    mixings, candidates = [], []
    turning = rotation_variance(inv_freq, statistics.context_length).double()
    for frequency in range(head_dim // 2):
        rows = keys[:, frequency]  # [Hkv, D]
        energy, vectors = torch.linalg.eigh(weighted[:, frequency] @ rows.conj().T)  # E[k k^H], ascending
        mixing = vectors.flip(1).conj().T  # [components, Hkv]: component c = sum_g mixing[c, g] k_g
        mixings.append(mixing)
        for component, value in enumerate(energy.flip(0).clamp(min=0).sqrt()):
            score = value * (turning[frequency] if selection == "rotation" else 1.0)
            candidates.append((score.item(), frequency, component))
    kept = sorted((frequency, component) for _, frequency, component in sorted(candidates, reverse=True)[:pairs])

    rope_key = torch.stack([mixings[f][c] @ keys[:, f] for f, c in kept])  # [N, D] complex
    rope_query = torch.stack(
        [torch.stack([queries[h, f] * mixings[f][c, h // group] for f, c in kept]) for h in range(len(query))]
    )  # [Hq, N, D]: Re(q_f conj(k_g,f)) = sum_c Re(q_f mixing[c, g] conj(component_c))
    remainder = []
    for frequency in range(head_dim // 2):
        dropped = torch.ones(key_heads, dtype=keys.dtype)
        dropped[[c for f, c in kept if f == frequency]] = 0
        mixing = mixings[frequency]
        remainder.append(mixing.conj().T @ (dropped[:, None] * (mixing @ keys[:, frequency])))
    return RopeSplit(
        frequencies=[[f for f, _ in kept]],
        rope_key=as_half_split(rope_key),
        rope_query=as_half_split(rope_query),
        nope_key=as_half_split(torch.stack(remainder, dim=1)),  # [Hkv, hd, D]
        nope_query=query,
    )


def split_exact(query: torch.Tensor, key: torch.Tensor) -> RopeSplit:
    """The RoPE-exact latent (`rope_split="exact"`): no rope key; the whole key goes through the latent and is
    rotated after it is rebuilt, so every rotary pair keeps its frequency and nothing of RoPE is approximated."""
    dims = key.shape[-1]
    return RopeSplit(
        frequencies=[],
        rope_key=key.new_zeros(0, dims),
        rope_query=query.new_zeros(query.shape[0], 0, dims),
        nope_key=key,
        nope_query=query,
    )


def split_rope(
    query: torch.Tensor,
    key: torch.Tensor,
    statistics: LayerStatistics,
    inv_freq: torch.Tensor,
    rope_split: str,
    pairs: int,
    selection: str,
) -> RopeSplit:
    """One layer's split, query [Hq, hd, D] and key [Hkv, hd, D] (float64): `rope_split` "per_head", "shared", or
    "exact" (the RoPE-exact latent)."""
    if rope_split == "exact":
        return split_exact(query, key)
    if rope_split == "per_head":
        return split_per_head(query, key, select_rope_pairs(statistics, inv_freq, pairs, selection))
    return split_shared(query, key, statistics, inv_freq, pairs, selection)


def llama_rope_parameters(source: LlamaForCausalLM) -> dict:
    """The source's rope parameters, in EG-MLA's (DeepSeek's) convention: Llama puts YaRN's mscale only into
    cos/sin, while EG-MLA would also square `mscale_all_dim` into the softmax scale, so the attention factor is
    given explicitly and the mscale keys are dropped."""
    layer_idx = families.global_layer(source.config)  # Gemma 3's windowed layers' base is `sliding_rope_theta`
    parameters = families.rope_parameters(source.config, layer_idx)
    if parameters.get("rope_type") == "yarn" and ("mscale" in parameters or "mscale_all_dim" in parameters):
        parameters.pop("mscale", None)
        parameters.pop("mscale_all_dim", None)
        parameters["attention_factor"] = families.attention_factor(source.model.rotary_emb, source.config, layer_idx)
    return parameters
