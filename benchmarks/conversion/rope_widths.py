"""Held-out perplexity of absorbable conversions at one budget: rope keys of several widths (shared, or one per KV
head), the gate on the latent or off; zero-shot and after the layer-wise fit, every variant from one calibration.

    python benchmarks/conversion/rope_widths.py tests/assets/stories260K-hf --kv-cut 0.5

Calibration: the first documents of the text cut into --block-size blocks; held out: the last 10% of its documents,
cut into blocks of the source's context (at most 512 tokens), which nothing is fitted on. The layer-wise fit sees the
calibration blocks packed to that length, as `egmla convert` does.
"""

import argparse
import time
from pathlib import Path

from egmla.conversion import ConversionOptions, calibrate, convert_llama_to_egmla, load_llama, load_tokenizer
from egmla.conversion.reconstruction import ReconstructionSettings, reconstruct_layers
from egmla.text import packed_blocks, perplexity, read_documents, split_documents, token_blocks

TEXT = Path(__file__).resolve().parents[2] / "../shared/assets/text/tinystories_train_2MiB.txt"
VARIANTS = (
    {"rope_pairs": 2},
    {"rope_pairs": 4},
    {"rope_pairs": 6},
    {"rope_pairs": 8},
    {"rope_pairs": 1, "rope_split": "per_head"},
    {"rope_pairs": 2, "rope_split": "per_head"},
    {"rope_pairs": 4, "gate_embedding_dim": 32, "gate_position": "latent"},
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="Llama folder or .gguf file")
    parser.add_argument("--kv-cut", type=float, default=0.5)
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--calibration-blocks", type=int, default=64)
    parser.add_argument("--eval-blocks", type=int, default=16)
    parser.add_argument("--reconstruction-steps", type=int, default=200)
    args = parser.parse_args()

    teacher, tokenizer = load_llama(args.source), load_tokenizer(args.source)
    fitting, held_out = split_documents(read_documents(args.text), 0.1)
    length = min(teacher.config.max_position_embeddings, 512)
    calibration = token_blocks(tokenizer, fitting[:2000], args.block_size)[: args.calibration_blocks]
    evaluation = token_blocks(tokenizer, held_out, length)[: args.eval_blocks]
    statistics = calibrate(teacher, calibration)
    packed = packed_blocks(calibration, length)
    settings = ReconstructionSettings(steps=args.reconstruction_steps, batch_size=max(1, 4 * args.block_size // length))
    source = perplexity(teacher, evaluation)
    print(f"source {source:.3f} ({len(evaluation)} held-out blocks of {length} tokens)")
    print("| variant | zero-shot | layer-wise |\n|---|---|---|")
    for variant in VARIANTS:
        started = time.time()
        options = ConversionOptions(kv_cut=args.kv_cut, **{"rope_split": "shared", **variant})
        student = convert_llama_to_egmla(teacher, options, statistics)
        zero_shot = perplexity(student, evaluation)
        fitted = "-"
        if args.reconstruction_steps:
            reconstruct_layers(student, teacher, packed, settings)
            fitted = f"{perplexity(student, evaluation):.3f}"
        name = ", ".join(f"{key}={value}" for key, value in variant.items())
        print(f"| {name} | {zero_shot:.3f} | {fitted} | ({time.time() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
