"""Retrofit a Llama checkpoint (MHA or GQA) into EG-MLA.

1. Calibrate: run the source on calibration text and collect, per layer, the covariance of the attention inputs
   and the mean 2-norm of every rotary pair of the queries and keys.
2. Partial RoPE: either one rope key shared by all heads (default; TransMLA's RoRoPE: per frequency, the principal
   components of the KV heads' keys, which RoPE rotates alike, the strongest become the rope key and the rest of
   every key becomes NoPE), or MHA2MLA's per-KV-head rope keys (each head keeps its `rope_pairs_per_head` pairs
   whose q.k contribution, weighted by how much their rotation varies over the context, is largest).
3. Low-rank: factorize the stacked NoPE key and value projections jointly into `W^{DKV}` (hidden -> latent) and
   `W^{UKV}` (latent -> per-head K/V): weight-only SVD, or activation-aware (whitened by the calibration
   covariance, as CARE, with rows weighted by where their errors reach the output: keys by the query covariance,
   values by the output projection), with an optional per-layer rank allocation by retained energy.
4. Assemble the EG-MLA model: the query rows permuted to [nope ; rope], the up-projection repeated for every
   query head of a group, everything else (MLP, norms, embeddings, RoPE base and scaling, attention scale) copied,
   and the gate at the identity, so the fresh model equals its MLA approximation.
"""

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from ..configuration_egmla import EGMLAConfig
from ..modeling_egmla import EGMLAForCausalLM
from ..text import token_blocks

FACTORIZATIONS = ("activation", "weight")
PAIR_SELECTIONS = ("rotation", "norm")
RANK_ALLOCATIONS = ("uniform", "energy")
ROPE_KEYS = ("shared", "per_head")


# ----------------------------------------------------------------------------------------------------------------
# Loading the source
# ----------------------------------------------------------------------------------------------------------------


def split_gguf(source: str | Path) -> tuple[str, str | None]:
    """A path to a `.gguf` file -> (its folder, its file name); anything else -> (source, None)."""
    path = Path(source)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file {path} does not exist.")
        return str(path.parent), path.name
    return str(source), None


def load_llama(source: str | Path | PreTrainedModel) -> LlamaForCausalLM:
    """A `LlamaForCausalLM` from an instance, a local folder, a Hub id or a GGUF file, in float32."""
    if isinstance(source, PreTrainedModel):
        # Work on a copy when the dtype or mode would change: the caller's model is never modified.
        model = source if source.dtype == torch.float32 and not source.training else copy.deepcopy(source)
    else:
        folder, gguf_file = split_gguf(source)
        config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
        if config.model_type != "llama":
            raise ValueError(
                f"{source} is a {config.model_type!r} checkpoint; only Llama (LlamaForCausalLM, MHA or GQA) "
                "sources can be converted."
            )
        model = LlamaForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
        if gguf_file is not None:
            # De-quantized to float32 on load: the GGUF quantization no longer describes these weights.
            del model.config.quantization_config
            model.hf_quantizer, model.is_quantized = None, False
    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(
            f"Got a {type(model).__name__}; only Llama (LlamaForCausalLM, MHA or GQA) sources can be converted."
        )
    config = model.config
    if config.attention_bias:
        raise ValueError("The source has attention biases (attention_bias=True); EG-MLA has none to map them to.")
    if getattr(config, "mlp_bias", False):
        raise ValueError("The source has MLP biases (mlp_bias=True); EG-MLA's SwiGLU MLP has none.")
    if config.rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("Sources with partial_rotary_factor != 1 are not supported.")
    if config.rope_parameters.get("rope_type", "default") == "longrope":
        raise ValueError("Sources with longrope scaling are not supported (its frequencies depend on the length).")
    return model.to(torch.float32).eval()


def load_tokenizer(source: str | Path | PreTrainedModel) -> PreTrainedTokenizerBase:
    name = source.config.name_or_path if isinstance(source, PreTrainedModel) else source
    if not name:
        raise ValueError("This in-memory model has no name_or_path to find its tokenizer by: pass token ids.")
    folder, gguf_file = split_gguf(name)
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)


# ----------------------------------------------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class LayerStatistics:
    """What conversion needs from calibration data, for one layer."""

    covariance: torch.Tensor  # [D, D] float64, E[x x^T] of the attention input
    query_pair_norms: torch.Tensor  # [Hq, hd/2] mean 2-norm of each rotary pair of every query head
    key_pair_norms: torch.Tensor  # [Hkv, hd/2]
    context_length: int  # length of the calibration blocks: the query-key distances the pairs must serve
    tokens: int


def pair_norms(states: torch.Tensor, heads: int) -> torch.Tensor:
    """states [N, heads*hd] -> summed 2-norm of each rotary pair (dims j and j + hd/2) [heads, hd/2]."""
    states = states.view(states.shape[0], heads, 2, -1)  # half-split: [N, heads, (first, second half), hd/2]
    return states.norm(dim=2).sum(dim=0)


@torch.no_grad()
def calibrate(model: LlamaForCausalLM, blocks: torch.Tensor, batch_size: int = 8) -> list[LayerStatistics]:
    """Runs the source on token blocks [N, S] and collects per-layer statistics of the attention inputs."""
    config = model.config
    hidden, layers = config.hidden_size, config.num_hidden_layers
    covariance = [torch.zeros(hidden, hidden, dtype=torch.float64) for _ in range(layers)]
    query_norms = [torch.zeros(config.num_attention_heads, config.head_dim // 2) for _ in range(layers)]
    key_norms = [torch.zeros(config.num_key_value_heads, config.head_dim // 2) for _ in range(layers)]
    counts = [0] * layers

    def hook(layer_idx: int):
        attention = model.model.layers[layer_idx].self_attn

        def record(module, args):
            inputs = args[0].reshape(-1, hidden).float()  # the normed hidden states entering q/k/v
            covariance[layer_idx] += (inputs.T.double() @ inputs.double()).cpu()
            # The projections by their weights: calling q_proj here would re-enter this hook.
            queries = inputs @ attention.q_proj.weight.T
            keys = inputs @ attention.k_proj.weight.T
            query_norms[layer_idx] += pair_norms(queries, config.num_attention_heads).cpu()
            key_norms[layer_idx] += pair_norms(keys, config.num_key_value_heads).cpu()
            counts[layer_idx] += inputs.shape[0]

        return record

    handles = [
        layer.self_attn.q_proj.register_forward_pre_hook(hook(index)) for index, layer in enumerate(model.model.layers)
    ]
    try:
        device = next(model.parameters()).device
        for start in tqdm(range(0, len(blocks), batch_size), desc="calibrating", unit="batch", leave=False):
            model(blocks[start : start + batch_size].to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [
        LayerStatistics(
            covariance=covariance[i] / counts[i],
            query_pair_norms=query_norms[i] / counts[i],
            key_pair_norms=key_norms[i] / counts[i],
            context_length=blocks.shape[1],
            tokens=counts[i],
        )
        for i in range(layers)
    ]


# ----------------------------------------------------------------------------------------------------------------
# Partial RoPE: which parts of the keys stay rotary
# ----------------------------------------------------------------------------------------------------------------


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
    covariance: torch.Tensor,
    inv_freq: torch.Tensor,
    context_length: int,
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
    covariance = covariance.to(keys.dtype)
    mixings, candidates = [], []
    turning = rotation_variance(inv_freq, context_length).double()
    for frequency in range(head_dim // 2):
        rows = keys[:, frequency]  # [Hkv, D]
        energy, vectors = torch.linalg.eigh(rows @ covariance @ rows.conj().T)  # E[k k^H], ascending
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


# ----------------------------------------------------------------------------------------------------------------
# Low-rank factorization of the NoPE keys and the values
# ----------------------------------------------------------------------------------------------------------------


def whitening(covariance: torch.Tensor, damping: float) -> torch.Tensor:
    """Lower-triangular S with S S^T = C + damping * mean(diag C) * I (float64)."""
    damped = covariance + damping * covariance.diagonal().mean() * torch.eye(len(covariance), dtype=covariance.dtype)
    return torch.linalg.cholesky(damped)


def psd_sqrt(matrix: torch.Tensor) -> torch.Tensor:
    """Symmetric square root of a positive semi-definite matrix, its tiny eigenvalues floored so it inverts."""
    values, vectors = torch.linalg.eigh(matrix)
    values = values.clamp(min=1e-8 * values.max().clamp(min=1e-30))
    return vectors @ torch.diag(values.sqrt()) @ vectors.T


def output_weights(
    split: RopeSplit,
    value: torch.Tensor,
    output: torch.Tensor,
    covariance: torch.Tensor,
    key_value_balance: float,
) -> torch.Tensor:
    """Row weights [rows, rows] for the stacked [NoPE key ; value] rows of every KV head, so that the factorization
    spends its rank where errors reach the output: a key error by the query covariance (E|q . dk|^2), a value
    error by the output projection of its heads (|O_h dv|^2). A logit error moves a head's output by about the
    spread of its values in the output space times the softmax scale, so the key block is scaled by that,
    times `key_value_balance`."""
    key_heads, head_dim = value.shape[0], value.shape[1]
    group = split.nope_query.shape[0] // key_heads
    blocks = []
    for g in range(key_heads):
        heads = range(g * group, (g + 1) * group)
        projections = [output[:, h * head_dim : (h + 1) * head_dim] for h in heads]  # O_h [D, hd]
        value_weight = psd_sqrt(sum(o.T @ o for o in projections))
        spread = sum(torch.trace(o @ value[g] @ covariance @ value[g].T @ o.T) for o in projections) / group
        if split.nope_key.shape[1]:
            query_covariance = sum(split.nope_query[h] @ covariance @ split.nope_query[h].T for h in heads)
            scale = key_value_balance * head_dim**-0.5 * spread.sqrt()
            blocks.append(torch.block_diag(scale * psd_sqrt(query_covariance), value_weight))
        else:
            blocks.append(value_weight)
    return torch.block_diag(*blocks)


@dataclass
class Factorization:
    """R W ~ (R up) @ down from an SVD whose singular values `spectrum` (of R W, or of R W S when whitened) are
    kept; R are optional row weights, undone when truncating."""

    left: torch.Tensor  # U [rows, k]
    spectrum: torch.Tensor  # sigma [k]
    right: torch.Tensor  # V^T [k, D] (already un-whitened)
    row_weights: torch.Tensor | None = None  # R [rows, rows]

    def truncate(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(down [rank, D], up [rows, rank]); sigma split evenly between the two."""
        root = self.spectrum[:rank].sqrt()
        up = self.left[:, :rank] * root[None, :]
        if self.row_weights is not None:
            up = torch.linalg.solve(self.row_weights, up)
        return root[:, None] * self.right[:rank], up

    def energy(self) -> torch.Tensor:
        """Fraction of the total squared spectrum carried by each direction, [k]."""
        squared = self.spectrum.square()
        return squared / squared.sum()


def factorize(
    weight: torch.Tensor,
    covariance: torch.Tensor | None,
    damping: float,
    row_weights: torch.Tensor | None = None,
) -> Factorization:
    """SVD of weight [rows, D]; with a covariance, of W S (activation-aware), then un-whitened by S^{-1}; with row
    weights R, of R W (S)."""
    weighted = weight.double() if row_weights is None else row_weights.double() @ weight.double()
    if covariance is None:
        left, spectrum, right = torch.linalg.svd(weighted, full_matrices=False)
        return Factorization(left, spectrum, right, row_weights)
    root = whitening(covariance, damping)
    left, spectrum, right = torch.linalg.svd(weighted @ root, full_matrices=False)
    # right @ S^{-1}: solve S^T X^T = right^T, S lower-triangular.
    right = torch.linalg.solve_triangular(root.T, right.T, upper=True).T
    return Factorization(left, spectrum, right, row_weights)


def allocate_ranks(factorizations: list[Factorization], rank: int, allocation: str) -> list[int]:
    """`uniform`: every layer gets `rank`. `energy`: the same total, given greedily to the directions that carry
    the largest share of their layer's energy (every layer keeps at least one)."""
    if allocation == "uniform":
        return [rank] * len(factorizations)
    energies = [f.energy() for f in factorizations]
    ranks = [1] * len(factorizations)
    candidates = [(energy[k].item(), layer, k) for layer, energy in enumerate(energies) for k in range(1, len(energy))]
    # Energies decrease along k, so taking the largest values globally keeps each layer's chosen set a prefix.
    for _, layer, _ in sorted(candidates, reverse=True)[: rank * len(factorizations) - len(factorizations)]:
        ranks[layer] += 1
    return ranks


# ----------------------------------------------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class ConversionPlan:
    """The settings resolved against the source."""

    kv_lora_rank: int | list[int]
    rope_keys: str
    rope_pairs_per_head: int
    source_values_per_token_per_layer: int
    target_values_per_token_per_layer: float


def llama_rope_parameters(teacher: LlamaForCausalLM) -> dict:
    """The source's rope parameters, in EG-MLA's (DeepSeek's) convention: Llama puts YaRN's mscale only into
    cos/sin, while EG-MLA would also square `mscale_all_dim` into the softmax scale, so the attention factor is
    given explicitly and the mscale keys are dropped."""
    parameters = dict(teacher.config.rope_parameters)
    if parameters.get("rope_type") == "yarn" and ("mscale" in parameters or "mscale_all_dim" in parameters):
        parameters.pop("mscale", None)
        parameters.pop("mscale_all_dim", None)
        parameters["attention_factor"] = float(teacher.model.rotary_emb.attention_scaling)
    return parameters


def rope_values_per_token(source_config, rope_keys: str, rope_pairs_per_head: int) -> int:
    """Values per token per layer the rope keys cache: one key per KV head, or one shared key."""
    rope_key_heads = source_config.num_key_value_heads if rope_keys == "per_head" else 1
    return rope_key_heads * 2 * rope_pairs_per_head


def kv_lora_rank_for_cut(source_config, kv_cut: float, rope_values: int) -> int:
    """The latent width that, with `rope_values` rope-key values, caches (1 - kv_cut) of the source's K/V values
    per token per layer."""
    source_values = 2 * source_config.num_key_value_heads * source_config.head_dim
    rank = round(source_values * (1 - kv_cut)) - rope_values
    if rank <= 0:
        raise ValueError(
            f"A {kv_cut:.2%} cut leaves {round(source_values * (1 - kv_cut))} values per token per layer, no more "
            f"than the {rope_values} values of the rope keys: lower --rope-pairs or the cut."
        )
    return rank


def default_rope_pairs(source_config, rope_keys: str) -> int:
    """MHA2MLA's default for per-head keys (head_dim / 16 pairs, at least 1); head_dim / 4 for a shared key (the
    best of 4, 8, 16 and 24 pairs for SmolLM2-135M at its 68.75% cut, by calibration perplexity)."""
    if rope_keys == "per_head":
        return max(1, source_config.head_dim // 16)
    return max(1, source_config.head_dim // 4)


def convert_llama_to_egmla(
    source: str | Path | PreTrainedModel,
    *,
    kv_lora_rank: int | None = None,
    kv_cut: float | None = None,
    rope_pairs_per_head: int | None = None,
    rope_keys: str = "shared",
    gate_embedding_dim: int = 0,
    gate_position: str = "kv",
    factorization: str = "activation",
    calibration_blocks: torch.Tensor | None = None,
    calibration_texts: list[str] | None = None,
    rank_allocation: str = "uniform",
    damping: float = 1e-2,
    key_value_balance: float = 0.5,
    statistics: list[LayerStatistics] | None = None,
    pair_selection: str = "rotation",
) -> EGMLAForCausalLM:
    """Converts a Llama checkpoint into an EG-MLA model (see the module docstring).

    Args:
        source: a `LlamaForCausalLM`, a local folder, a Hub id, or a `.gguf` file.
        kv_lora_rank / kv_cut: the latent width, or the fraction of the source's K/V cache values to remove
            (the latent then takes what the rope keys leave of the budget). Exactly one is needed.
        rope_pairs_per_head: rotary pairs in each rope key. `rope_keys="per_head"`: per KV head (default
            `head_dim // 16`, at least 1; all `head_dim // 2` keep RoPE exact). `"shared"`: in the one key all
            heads share (default `head_dim // 4`; all `num_key_value_heads * head_dim // 2` keep RoPE exact).
        rope_keys: `"shared"` (TransMLA's RoRoPE, one rope key from the principal components of the KV heads) or
            `"per_head"` (MHA2MLA's partial RoPE, one rope key per KV head).
        gate_embedding_dim: width of the gate tables (0 = plain MLA); the gate starts as the identity.
        factorization: `"activation"` (whitened by the calibration covariance, rows weighted by where their errors
            reach the output) or `"weight"` (plain SVD).
        calibration_blocks: token ids [N, S] for calibration; needed for `"activation"` and to choose rope pairs
            (without them the pairs are chosen by weight norms alone).
        calibration_texts: documents to calibrate on instead, tokenized with the source's tokenizer into blocks
            of 256 tokens.
        rank_allocation: `"uniform"` (every layer `kv_lora_rank`) or `"energy"` (per-layer ranks, same total).
        damping: added to the covariance before whitening, as a fraction of its mean diagonal.
        key_value_balance: weight of key errors against value errors in `"activation"` factorization (0.5 was
            chosen by calibration perplexity on stories260K among 0.25, 0.5, 0.7, 1).
        statistics: precomputed `calibrate(...)` output, to convert several ways without recalibrating.
        pair_selection: `"rotation"` (contribution x rotation variance, ours) or `"norm"` (contribution alone,
            MHA2MLA's 2-norm for per-head keys).
    """
    for name, value, allowed in (
        ("factorization", factorization, FACTORIZATIONS),
        ("pair_selection", pair_selection, PAIR_SELECTIONS),
        ("rank_allocation", rank_allocation, RANK_ALLOCATIONS),
        ("rope_keys", rope_keys, ROPE_KEYS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}.")
    if (kv_lora_rank is None) == (kv_cut is None):
        raise ValueError("Give exactly one of kv_lora_rank and kv_cut.")
    if kv_cut is not None and not 0 < kv_cut < 1:
        raise ValueError(f"kv_cut must lie in (0, 1), got {kv_cut}.")

    teacher = load_llama(source)
    config = teacher.config
    if calibration_texts is not None:
        if calibration_blocks is not None:
            raise ValueError("Give calibration_blocks or calibration_texts, not both.")
        calibration_blocks = token_blocks(load_tokenizer(source), calibration_texts, 256)
    head_dim, key_heads, query_heads = config.head_dim, config.num_key_value_heads, config.num_attention_heads
    group = query_heads // key_heads
    pairs = rope_pairs_per_head if rope_pairs_per_head is not None else default_rope_pairs(config, rope_keys)
    max_pairs = head_dim // 2 if rope_keys == "per_head" else key_heads * head_dim // 2
    if not 1 <= pairs <= max_pairs:
        raise ValueError(
            f"rope_pairs_per_head must lie in [1, {max_pairs}] for rope_keys={rope_keys!r} (head_dim {head_dim}, "
            f"{key_heads} KV heads), got {pairs}."
        )
    nope_dim = head_dim - 2 * pairs if rope_keys == "per_head" else head_dim
    if kv_cut is not None:
        kv_lora_rank = kv_lora_rank_for_cut(config, kv_cut, rope_values_per_token(config, rope_keys, pairs))
    stacked_rows = key_heads * (nope_dim + head_dim)
    max_rank = min(stacked_rows, config.hidden_size)
    if not 1 <= kv_lora_rank <= max_rank:
        raise ValueError(
            f"kv_lora_rank {kv_lora_rank} is out of range: the stacked NoPE-key/value projection of this source is "
            f"{stacked_rows} x {config.hidden_size}, so the rank must lie in [1, {max_rank}]."
        )

    if statistics is None:
        if calibration_blocks is None:
            if factorization == "activation":
                raise ValueError('factorization="activation" needs calibration_blocks (token ids [N, S]).')
        else:
            statistics = calibrate(teacher, calibration_blocks)

    layers = teacher.model.layers
    inv_freq = teacher.model.rotary_emb.inv_freq.float().cpu()
    context_length = (
        statistics[0].context_length if statistics is not None else min(config.max_position_embeddings, 4096)
    )
    splits, factorizations = [], []
    for layer_idx, layer in enumerate(tqdm(layers, desc="factorizing", unit="layer", leave=False)):
        attention = layer.self_attn
        query = attention.q_proj.weight.detach().double().cpu().view(query_heads, head_dim, -1)
        key = attention.k_proj.weight.detach().double().cpu().view(key_heads, head_dim, -1)
        value = attention.v_proj.weight.detach().double().cpu().view(key_heads, head_dim, -1)
        # Without calibration data the choices fall back to the weights alone (an identity covariance).
        covariance = statistics[layer_idx].covariance if statistics is not None else torch.eye(config.hidden_size)
        covariance = covariance.double()
        if rope_keys == "per_head":
            layer_statistics = (
                statistics[layer_idx]
                if statistics is not None
                else LayerStatistics(
                    covariance=covariance,
                    query_pair_norms=pair_norms(attention.q_proj.weight.detach().T, query_heads),
                    key_pair_norms=pair_norms(attention.k_proj.weight.detach().T, key_heads),
                    context_length=context_length,
                    tokens=0,
                )
            )
            split = split_per_head(query, key, select_rope_pairs(layer_statistics, inv_freq, pairs, pair_selection))
        else:
            split = split_shared(query, key, covariance, inv_freq, context_length, pairs, pair_selection)
        splits.append(split)

        stacked = torch.cat([torch.cat([split.nope_key[g], value[g]]) for g in range(key_heads)])
        # [Hkv * (dn + hd), D]: per KV head its NoPE key rows, then its value rows
        if factorization == "activation":
            output = attention.o_proj.weight.detach().double().cpu()
            weights = output_weights(split, value, output, covariance, key_value_balance)
            factorizations.append(factorize(stacked, covariance, damping, weights))
        else:
            factorizations.append(factorize(stacked, None, damping))

    ranks = allocate_ranks(factorizations, kv_lora_rank, rank_allocation)
    egmla_config = EGMLAConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=query_heads,
        q_lora_rank=None,
        kv_lora_rank=ranks if rank_allocation == "energy" else kv_lora_rank,
        qk_nope_head_dim=nope_dim,
        qk_rope_head_dim=2 * pairs,
        v_head_dim=head_dim,
        rope_key_heads=key_heads if rope_keys == "per_head" else 1,
        gate_embedding_dim=gate_embedding_dim,
        gate_position=gate_position,
        gate_norm="none",  # a norm after the gate would change the function: the fresh gate must be the identity
        kv_latent_norm=False,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters=llama_rope_parameters(teacher),
        rope_frequency_dim=head_dim,
        rope_frequency_indices=[split.frequencies for split in splits],
        attention_dropout=config.attention_dropout,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        initializer_range=config.initializer_range,
    )
    torch.manual_seed(0)  # the gate tables are random rows (the gate is still the identity): make them repeatable
    student = EGMLAForCausalLM(egmla_config)

    # The student's softmax scale is 1/sqrt(dn + dr), the source's 1/sqrt(hd): the queries make up the difference.
    query_factor = ((nope_dim + 2 * pairs) / head_dim) ** 0.5
    # The source scales whole heads by the rope's attention factor (YaRN); NoPE dims must keep it.
    nope_factor = query_factor * teacher.model.rotary_emb.attention_scaling**2
    state = {}
    for layer_idx, (layer, split) in enumerate(zip(layers, splits, strict=True)):
        prefix = f"model.layers.{layer_idx}.self_attn."
        down, up = factorizations[layer_idx].truncate(ranks[layer_idx])
        up = up.view(key_heads, nope_dim + head_dim, -1)  # per KV head: [NoPE key ; value] rows
        state[prefix + "q_proj.weight"] = torch.cat(
            [
                torch.cat([nope_factor * split.nope_query[h], query_factor * split.rope_query[h]])
                for h in range(query_heads)
            ]
        ).float()
        state[prefix + "kv_a_proj_with_mqa.weight"] = torch.cat([down, split.rope_key]).float()
        state[prefix + "kv_b_proj.weight"] = torch.cat([up[h // group] for h in range(query_heads)]).float()
        state[prefix + "o_proj.weight"] = layer.self_attn.o_proj.weight
    for name, tensor in teacher.state_dict().items():
        if ".self_attn." not in name and "rotary_emb" not in name:
            state[name] = tensor
    missing, unexpected = student.load_state_dict(state, strict=False)
    # Only the gate starts fresh (identity): tables random, up-projection zero.
    assert all("gate_" in name for name in missing) and not unexpected, (missing, unexpected)
    if config.tie_word_embeddings:
        student.tie_weights()
    student.conversion_plan = ConversionPlan(
        kv_lora_rank=egmla_config.kv_lora_rank,
        rope_keys=rope_keys,
        rope_pairs_per_head=pairs,
        source_values_per_token_per_layer=2 * key_heads * head_dim,
        target_values_per_token_per_layer=egmla_config.kv_cache_values_per_token() / config.num_hidden_layers,
    )
    return student.eval()
