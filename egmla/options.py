"""Options declared once: a dataclass field made with `option` carries its help text, its choices and its interval,
and `add_fields` turns such fields into command-line flags (`--field-name`) with the dataclass's
default, so that the CLI, the dataclasses and their validation read the same declaration."""

import argparse
import dataclasses
import math
import os
import types
import typing
from pathlib import Path
from typing import Any

import torch


def option(
    default: Any,
    help: str,
    choices: tuple | None = None,
    bounds: str | None = None,
    input_file: bool = False,
) -> Any:
    """A dataclass field with its flag's help, its allowed values, its interval (`bounds`, such as "[1, inf)" or
    "(0, 1)", for each value of a tuple too) and whether it names a text file to read; all are checked by
    `check_fields`."""
    metadata = {"help": help, "choices": choices, "bounds": bounds, "input_file": input_file}
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(instance: Any, name: str) -> str:
    """The command-line flag of a field (after the dataclass's `flag_prefix`, if it has one)."""
    return "--" + (getattr(instance, "flag_prefix", "") + name).replace("_", "-")


def check_fields(instance: Any) -> None:
    """A ValueError naming the flag of the first `option` field whose value is outside its choices or its interval
    (NaN included), or whose text file is missing or empty. None is every optional field's "not given"."""
    for field in dataclasses.fields(instance):
        value, metadata = getattr(instance, field.name), field.metadata
        if "help" not in metadata or value is None:
            continue
        name = f"{field.name} ({flag_name(instance, field.name)})"
        if metadata["choices"] is not None and value not in metadata["choices"]:
            raise ValueError(f"{name} must be one of {metadata['choices']}, got {value!r}.")
        for item in value if isinstance(value, tuple) else (value,):
            if metadata["bounds"] is not None:
                check_bounds(name, item, metadata["bounds"])
            if metadata["input_file"]:
                check_text_file(name, Path(item))


def check_bounds(name: str, value: float, bounds: str) -> None:
    """`value` inside `bounds` ("[0, 1)", "(0, inf)", ...), or a ValueError saying which interval."""
    low, high = (float(end) for end in bounds[1:-1].split(","))
    inside = (low <= value if bounds[0] == "[" else low < value) and (
        value <= high if bounds[-1] == "]" else value < high
    )
    if not inside:  # NaN too: every comparison with it is False
        wanted = f"be {'>=' if bounds[0] == '[' else '>'} {low:g}" if math.isinf(high) else f"lie in {bounds}"
        number = "be a number and " if math.isnan(value) else ""
        raise ValueError(f"{name} must {number}{wanted}, got {value}.")


def check_text_file(name: str, path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{name}: {path} is not a file (no such file, or a folder).")
    with path.open("rb") as handle:
        if not handle.read(1 << 16).strip():
            raise ValueError(f"{name}: {path} is empty: give documents separated by <|endoftext|>.")


def value_type(annotation: Any) -> type:
    """int for `int | None`, Path for `Path | None`, and so on: what argparse converts a flag's text with."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    return annotation if annotation in (int, float, str, bool, Path) else str


def add_fields(parser: argparse.ArgumentParser, cls: type, names: tuple[str, ...] | None = None) -> None:
    """One flag per `option` field of `cls` (or of those in `names`), with the field's default, choices and help;
    the class's `flag_prefix` (e.g. "reconstruction_"), if any, goes before each flag's name and destination."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if "help" not in field.metadata or (names is not None and field.name not in names):
            continue
        flag = flag_name(cls, field.name)
        kind, help_text = value_type(hints[field.name]), field.metadata["help"].replace("%", "%%")
        if kind is bool:  # --name and --no-name: a default of True can be turned off too
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=help_text)
            continue
        choices, many = field.metadata["choices"], typing.get_origin(hints[field.name]) is tuple
        if many:  # tuple[X, ...]: any number of values after the flag, kept as a tuple
            kind = typing.get_args(hints[field.name])[0]
        parser.add_argument(flag, type=kind, default=field.default, choices=choices, help=help_text,
                            **({"nargs": "*"} if many else {}))  # fmt: skip


DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a command's models run and in which dtype. Calibration statistics and factorizations are accumulated
    in float32/float64 on the host whatever the weights' dtype; a conversion saves its output in this dtype."""

    device: str = option(
        "auto", "where the models run: auto (this process's accelerator when there is one, else cpu), cpu, cuda:1, ..."
    )
    dtype: str = option("float32", "the weights' dtype (the saved output's too)", DTYPES)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError as error:
                raise ValueError(
                    f"device must be 'auto' or a torch device ('cpu', 'cuda', 'cuda:1', ...), got {self.device!r}."
                ) from error

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def torch_device(self) -> torch.device:
        """The device itself. "auto": this process's accelerator (index LOCAL_RANK under `accelerate launch`), unless
        there is none or accelerate is told to use the CPU (ACCELERATE_USE_CPU); resolved without initializing
        accelerate's process state, which the training's Accelerator must create itself."""
        if self.device == "auto":
            from accelerate.utils import parse_flag_from_env  # lazily: `import egmla` stays light

            if not torch.accelerator.is_available() or parse_flag_from_env("ACCELERATE_USE_CPU"):
                return torch.device("cpu")
            return torch.device(torch.accelerator.current_accelerator().type, int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device(self.device)
        if device.type != "cpu" and (
            not torch.accelerator.is_available() or torch.accelerator.current_accelerator().type != device.type
        ):
            raise ValueError(f"device {self.device!r} is not available on this machine (use 'cpu' or 'auto').")
        return device
