"""The plugin's fp32 decode over the paged latent cache against the path it replaces (each request's rows gathered by
its block table, then SDPA), side by side in one process, on SmolLM2's conversion's row (9 query heads over a latent
of 90 and a rope key of 30), per layer and step. Run with the vLLM venv's python:

    PYTHONPATH=integrations/vllm .venv-vllm/bin/python benchmarks/serving/vllm_decode_kernel.py
"""

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
from egmla_vllm.attention import request_rows
from egmla_vllm.cpu_kernels import paged_latent_decode


def gathered_sdpa(query, cache, decode, scale: float, values: int) -> torch.Tensor:
    rows, valid = request_rows(cache, decode.block_table, decode.seq_lens.to(torch.long))
    attended = torch.nn.functional.scaled_dot_product_attention(
        query[:, None], rows[:, None], rows[:, None], attn_mask=valid[:, None, None], scale=scale
    )
    return attended[:, 0, :, :values]


def median_ms(run, repetitions: int) -> float:
    run()
    times = []
    for _ in range(repetitions):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


HEADS, WIDTH, VALUES = 9, 120, 90  # SmolLM2's conversion: 9 query heads, a latent of 90 and a rope key of 30


def cell_row(requests: int, context: int, block_size: int, repetitions: int) -> str:
    """One cell's medians (ms) and their ratio, after checking that both paths agree."""
    blocks, scale = -(-context // block_size), WIDTH**-0.5
    torch.manual_seed(0)
    cache = torch.randn(requests * blocks + 8, block_size, WIDTH)
    table = torch.randperm(len(cache))[: requests * blocks].view(requests, blocks).to(torch.int32)
    decode = SimpleNamespace(block_table=table, seq_lens=torch.full((requests,), context, dtype=torch.int32))
    query, out = torch.randn(requests, HEADS, WIDTH), torch.empty(requests, HEADS, VALUES)
    assert paged_latent_decode(query, cache, table, decode.seq_lens, scale, out), "the kernel did not build"
    torch.testing.assert_close(out, gathered_sdpa(query, cache, decode, scale, VALUES), rtol=1e-4, atol=1e-5)
    base = median_ms(lambda: gathered_sdpa(query, cache, decode, scale, VALUES), repetitions)
    kernel = median_ms(lambda: paged_latent_decode(query, cache, table, decode.seq_lens, scale, out), repetitions)
    return f"| {requests} x {context} | {base:.3f} | {kernel:.3f} | {kernel / base:.2f}x |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", nargs="+", default=["1x512", "8x2048", "32x1152", "64x2176"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repetitions", type=int, default=30)
    args = parser.parse_args()
    print("| requests x context | gathered + SDPA ms | kernel ms | kernel vs gathered |\n|---|---|---|---|")
    for cell in args.cells:
        requests, context = map(int, cell.split("x"))
        print(cell_row(requests, context, args.block_size, args.repetitions))


if __name__ == "__main__":
    main()
