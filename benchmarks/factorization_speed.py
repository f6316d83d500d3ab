"""What one layer's factorization costs as the source grows: the two products that used to dominate it, each as it
is against the formula it replaced, interleaved on the same random decoder layer of a real shape, same values, with
the ratio; and the whole `factorize_layer` as it is now.

    python benchmarks/factorization_speed.py --shapes smollm2-135m llama-3.2-1b llama-3.1-8b

- the value spread of a KV group in the row weights (`factorization.output_weights`): tr(V C V^T sum_h O_h^T O_h)
  over [hd, hd] products, against sum_h tr(O_h V C V^T O_h^T) over [D, D] products per query head;
- the keys' second moments per frequency in the shared rope split (`rope.split_shared`): the real covariance times
  the keys' real and imaginary rows at every frequency in one product, against a complex [Hkv, D] x [D, D] product
  per frequency.

The layer has random weights (N(0, 0.02)); its calibration statistics come from 8 random blocks of 256 positions.
"""

import argparse
import time

import torch
from conversion_scale import SHAPES
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from egmla.conversion.convert import ConversionOptions, factorize_layer, resolve_budget, source_rows
from egmla.conversion.layer_stream import run_layer
from egmla.conversion.rope import as_complex


def random_layer(shape: tuple) -> tuple[LlamaDecoderLayer, LlamaRotaryEmbedding, LlamaConfig]:
    hidden, _, heads, key_heads, mlp, vocab, _ = shape
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
                         num_key_value_heads=key_heads, intermediate_size=mlp, vocab_size=vocab,
                         max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 1e5})  # fmt: skip
    config._attn_implementation = "sdpa"  # a layer built alone has no model to set it
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, 0).to(torch.bfloat16).eval()
    for parameter in layer.parameters():
        if parameter.dim() > 1:
            parameter.data.normal_(0.0, 0.02)
    return layer, LlamaRotaryEmbedding(config), config


def spreads(value: torch.Tensor, output: torch.Tensor, covariance: torch.Tensor, previous: bool) -> torch.Tensor:
    """Every KV group's value spread times its group size, [Hkv]."""
    key_heads, head_dim = value.shape[0], value.shape[1]
    group = output.shape[1] // head_dim // key_heads
    rows = []
    for g in range(key_heads):
        projections = [output[:, h * head_dim : (h + 1) * head_dim] for h in range(g * group, (g + 1) * group)]
        if previous:
            rows.append(sum(torch.trace(o @ value[g] @ covariance @ value[g].T @ o.T) for o in projections))
        else:
            rows.append(torch.trace(value[g] @ covariance @ value[g].T @ sum(o.T @ o for o in projections)))
    return torch.stack(rows)


def key_moments(keys: torch.Tensor, covariance: torch.Tensor, previous: bool) -> torch.Tensor:
    """E[k k^H] of the KV heads' keys at every frequency, [hd/2, Hkv, Hkv]."""
    if previous:
        complex_covariance = covariance.to(keys.dtype)
        return torch.stack([keys[:, f] @ complex_covariance @ keys[:, f].conj().T for f in range(keys.shape[1])])
    weighted = torch.complex(keys.real @ covariance, keys.imag @ covariance)
    return torch.stack([weighted[:, f] @ keys[:, f].conj().T for f in range(keys.shape[1])])


def timed(function, *arguments) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    result = function(*arguments)
    return time.perf_counter() - started, result


def measure(name: str, repeats: int) -> dict:
    layer, rotary, config = random_layer(SHAPES[name])
    hidden = torch.randn(8, 256, config.hidden_size, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    statistics, _ = run_layer(layer, hidden, rotary)
    covariance = statistics.covariance.double()
    _, key, value = source_rows(layer.self_attn)
    output, keys = layer.self_attn.o_proj.weight.detach().double(), as_complex(key)
    parts = {"value spread": (spreads, (value, output, covariance)), "key moments": (key_moments, (keys, covariance))}
    seconds = {part: {"previous": [], "current": []} for part in parts}
    for _ in range(repeats):
        for part, (function, arguments) in parts.items():
            results = {}
            for label in ("previous", "current"):  # interleaved: the machine's noise falls on both
                elapsed, results[label] = timed(function, *arguments, label == "previous")
                seconds[part][label].append(elapsed)
            scale = results["previous"].abs().max().item()
            torch.testing.assert_close(results["current"], results["previous"], rtol=1e-9, atol=1e-12 * scale)
    options = ConversionOptions(kv_cut=0.6875, rope_split="shared")
    budget = resolve_budget(config, options)
    whole, _ = timed(factorize_layer, layer.self_attn, statistics, rotary.inv_freq.float(), budget, options)
    best = {part: {label: min(values) for label, values in times.items()} for part, times in seconds.items()}
    return {"shape": name, **best, "factorize_layer": whole}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["smollm2-135m", "llama-3.2-1b"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    rows = [measure(name, args.repeats) for name in args.shapes]
    print(f"one layer's factorization products (best of {args.repeats}, interleaved, same values), seconds:")
    print("| shape | value spread: previous / current | key moments: previous / current | factorize_layer now |")
    print("|---|---|---|---|")
    for row in rows:
        cells = [
            f"{row[part]['previous']:.2f} / {row[part]['current']:.2f} "
            f"({row[part]['previous'] / row[part]['current']:.1f}x)"
            for part in ("value spread", "key moments")
        ]
        print(f"| {row['shape']} | {cells[0]} | {cells[1]} | {row['factorize_layer']:.2f} |")
    return rows


if __name__ == "__main__":
    main()
