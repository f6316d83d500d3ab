"""Data-free text sampling speed: tokens/s of `generate` from the source's BOS at several batch widths, in one
process, as ratios to 32 rows (`egmla.sampling.Sampling.batch_size` is 64).

    python benchmarks/conversion/sampling.py                     # SmolLM2-135M (the main job's source), 32 new tokens
"""

import argparse
import time

import torch

from egmla.conversion.source import load_llama
from egmla.data import smollm2_gguf


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=None, help="a Llama folder or .gguf (default: the SmolLM2 wheel)")
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    model = load_llama(args.source or smollm2_gguf())
    rates = {}
    for width in args.widths:
        prompt = torch.full((width, 1), model.config.bos_token_id or 0)
        started = time.perf_counter()
        model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=0, top_p=1.0,
                       max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0)  # fmt: skip
        rates[width] = width * args.new_tokens / (time.perf_counter() - started)
    print(f"| rows | tokens/s | vs {args.widths[0]} rows |\n|---|---|---|")
    for width, rate in rates.items():
        print(f"| {width} | {rate:.0f} | {rate / rates[args.widths[0]]:.2f}x |")


if __name__ == "__main__":
    main()
