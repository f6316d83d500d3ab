"""Low-rank factorization of the stacked NoPE-key and value projections into W^{DKV} (hidden -> latent) and W^{UKV}
(latent -> per-head K/V): weight-only SVD, or activation-aware (whitened by the calibration covariance, as CARE,
with rows weighted by where their errors reach the output), and the allocation of ranks across layers."""

from dataclasses import dataclass

import torch

from .rope import RopeSplit

FACTORIZATIONS = ("activation", "weight")
RANK_ALLOCATIONS = ("uniform", "energy")


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
        gram = sum(o.T @ o for o in projections)  # sum_h O_h^T O_h [hd, hd]
        value_weight = psd_sqrt(gram)
        # sum_h tr(O_h V C V^T O_h^T) = tr(V C V^T gram): [hd, hd] products instead of [D, D] ones per head.
        spread = torch.trace(value[g] @ covariance @ value[g].T @ gram) / group
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
        """(down [rank, D], up [rows, rank]), each latent direction scaled so that its row of `down` and its column
        of `up` have the same norm (the product is unchanged; in float32 it loses the least)."""
        root = self.spectrum[:rank].sqrt()
        up = self.left[:, :rank] * root[None, :]
        if self.row_weights is not None:
            up = torch.linalg.solve(self.row_weights, up)
        down = root[:, None] * self.right[:rank]
        balance = (up.norm(dim=0) / down.norm(dim=1).clamp(min=1e-30)).sqrt().clamp(min=1e-30)  # [rank]
        return balance[:, None] * down, up / balance[None, :]

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


def allocate_ranks(energies: list[torch.Tensor], rank: int, allocation: str) -> list[int]:
    """Per layer, from its factorization's `energy()`: `uniform`: every layer gets `rank`. `energy`: the same
    total, given greedily to the directions that carry the largest share of their layer's energy (every layer
    keeps at least one)."""
    if allocation == "uniform":
        return [rank] * len(energies)
    ranks = [1] * len(energies)
    candidates = [(energy[k].item(), layer, k) for layer, energy in enumerate(energies) for k in range(1, len(energy))]
    # Energies decrease along k, so taking the largest values globally keeps each layer's chosen set a prefix.
    for _, layer, _ in sorted(candidates, reverse=True)[: rank * len(energies) - len(energies)]:
        ranks[layer] += 1
    return ranks
