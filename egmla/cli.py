"""Command line: `egmla quickstart` (the README's main job)."""

import argparse
from pathlib import Path

from .quickstart import DEFAULT_TEXT, DEFAULT_TOKENIZER, QuickstartSettings, run_quickstart


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="egmla", description="EG-MLA for Hugging Face transformers")
    commands = parser.add_subparsers(dest="command", required=True)

    quick = commands.add_parser(
        "quickstart", help="train a small EG-MLA from scratch, measure its cache, save a Hub-ready folder"
    )
    quick.add_argument("--out", type=Path, default=Path("runs/quickstart"), help="output folder")
    quick.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="training text, <|endoftext|>-separated")
    quick.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER, help="tokenizer folder")
    quick.add_argument("--steps", type=int, default=500)
    quick.add_argument("--batch-size", type=int, default=16)
    quick.add_argument("--block-size", type=int, default=128)
    quick.add_argument("--kv-lora-rank", type=int, default=16)
    quick.add_argument("--gate-dim", type=int, default=64)
    quick.add_argument("--seed", type=int, default=0)
    quick.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "quickstart":
        if args.steps <= 0:
            raise SystemExit("--steps must be positive")
        try:
            run_quickstart(
                QuickstartSettings(
                    out=args.out,
                    text=args.text,
                    tokenizer=args.tokenizer,
                    steps=args.steps,
                    batch_size=args.batch_size,
                    block_size=args.block_size,
                    kv_lora_rank=args.kv_lora_rank,
                    gate_embedding_dim=args.gate_dim,
                    seed=args.seed,
                    overwrite=args.overwrite,
                )
            )
        except (FileExistsError, FileNotFoundError, ValueError) as error:
            raise SystemExit(f"egmla quickstart: {error}") from error


if __name__ == "__main__":
    main()
