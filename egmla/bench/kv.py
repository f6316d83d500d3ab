"""Panel (c): K/V cache elements per token, read off the cache objects of real `generate` calls."""

import torch

from ..measure import kv_values_per_token
from .models import LABELS, NAMES, build, paper_dims


def expected_elements_per_token(name: str, dims: dict) -> int:
    """The arithmetic the measurement must match (all layers)."""
    layers = dims["num_hidden_layers"]
    if name == "mha":
        return 2 * dims["hidden_size"] * layers
    rank = {"mla-base": 256, "deepseek-v3-mla": 256, "egmla-kv64": 64, "egmla-kv64-latent": 64, "egmla-kv16": 16}[name]
    return (rank + dims["qk_rope_head_dim"]) * layers


def run_kv(quick: bool = False) -> dict:
    """Measures every model of NAMES; `quick`: one layer and a small vocabulary (per-layer numbers)."""
    dims = paper_dims(layers=1, vocab_size=512) if quick else paper_dims()
    prompt = torch.randint(0, dims["vocab_size"] - 1, (2, 16), generator=torch.Generator().manual_seed(0))
    rows = {}
    for name in NAMES:
        model = build(name, dims)
        with torch.no_grad():
            measured = kv_values_per_token(model, prompt, new_tokens=8)
        elements = measured["values_per_token_per_layer"] * dims["num_hidden_layers"]
        rows[name] = {
            "label": LABELS[name],
            "elements_per_token": elements,
            "expected": expected_elements_per_token(name, dims),
            "token_id_bytes_per_token": measured["token_id_bytes_per_token"],
        }
        del model
    mha, mla = rows["mha"]["elements_per_token"], rows["mla-base"]["elements_per_token"]
    for row in rows.values():
        row["vs_mha"] = row["elements_per_token"] / mha - 1
        row["vs_mla_base"] = row["elements_per_token"] / mla - 1
    return {"layers": dims["num_hidden_layers"], "vocab_size": dims["vocab_size"], "rows": rows}


def print_kv(result: dict) -> None:
    print(f"K/V cache elements per token, all {result['layers']} layers, measured on the caches after generate")
    print("| model | elements/token | expected | vs MHA | vs MLA-Base | + token id bytes |\n|---|---|---|---|---|---|")
    for row in result["rows"].values():
        print(
            f"| {row['label']} | {row['elements_per_token']:,.0f} | {row['expected']:,} | {row['vs_mha']:+.1%} "
            f"| {row['vs_mla_base']:+.1%} | {row['token_id_bytes_per_token']:.0f} |"
        )
