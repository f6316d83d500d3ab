"""What the calibration pass costs: `calibrate` as it is against the pass it replaced (the pair norms by
`Tensor.norm` over the middle dimension of size 2, and the whole model run with its head), interleaved on the same
blocks in one process, with the ratio; the two give the same statistics.

    python benchmarks/calibration_speed.py --blocks 16 --repeats 3

The source is SmolLM2-135M (the main job's GGUF) unless `--source` names a Llama folder.
"""

import argparse
import time

import torch

from egmla.conversion import calibration, load_llama
from egmla.data import smollm2_gguf


def norm_pair_norms(states: torch.Tensor, heads: int) -> torch.Tensor:
    """The replaced formula: a norm over the middle dimension of size 2."""
    return states.view(states.shape[0], heads, 2, -1).norm(dim=2).sum(dim=0)


@torch.no_grad()
def previous_calibrate(model, blocks: torch.Tensor, batch_size: int = 8) -> list:
    """The replaced pass: the whole model (logits included), the norm formula."""
    recorders = [calibration.StatisticsRecorder(layer.self_attn) for layer in model.model.layers]
    handles = [
        layer.self_attn.q_proj.register_forward_pre_hook(recorder)
        for layer, recorder in zip(model.model.layers, recorders, strict=True)
    ]
    current, calibration.pair_norms = calibration.pair_norms, norm_pair_norms
    try:
        for start in range(0, len(blocks), batch_size):
            model(blocks[start : start + batch_size], use_cache=False)
    finally:
        calibration.pair_norms = current
        for handle in handles:
            handle.remove()
    return [recorder.statistics() for recorder in recorders]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", default=None, help="a Llama folder (default: SmolLM2-135M's GGUF)")
    parser.add_argument("--blocks", type=int, default=16, help="random token blocks of --block-size")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    model = load_llama(args.source or smollm2_gguf()).eval()
    blocks = torch.randint(
        0, model.config.vocab_size, (args.blocks, args.block_size), generator=torch.Generator().manual_seed(0)
    )
    passes = {"previous": previous_calibrate, "current": calibration.calibrate}
    seconds = {name: [] for name in passes}
    results = {}
    for _ in range(args.repeats):
        for name, calibrate in passes.items():  # interleaved: the machine's noise falls on both
            started = time.perf_counter()
            results[name] = calibrate(model, blocks)
            seconds[name].append(time.perf_counter() - started)
    for old, new in zip(results["previous"], results["current"], strict=True):
        torch.testing.assert_close(new.covariance, old.covariance)
        torch.testing.assert_close(new.query_pair_norms, old.query_pair_norms, rtol=1e-5, atol=1e-6)
    best = {name: min(values) for name, values in seconds.items()}
    print(f"calibration of {args.blocks} blocks of {args.block_size} (best of {args.repeats}, same statistics):")
    print(
        f"  previous {best['previous']:.2f} s, current {best['current']:.2f} s: {best['previous'] / best['current']:.2f}x faster"
    )
    return best


if __name__ == "__main__":
    main()
