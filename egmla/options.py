"""Options declared once: a dataclass field made with `option` carries its help text, its choices and any older
flag spellings, and `add_fields` turns such fields into command-line flags (`--field-name`) with the dataclass's
default, so that the CLI, the dataclasses and their validation read the same declaration."""

import argparse
import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any

import torch


def option(default: Any, help: str, choices: tuple | None = None, flags: tuple[str, ...] = ()) -> Any:
    """A dataclass field with its flag's help, its allowed values (checked by `check_choices` too) and aliases."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "flags": flags})


def check_choices(instance: Any) -> None:
    """A ValueError naming the field whose value is not one of its declared choices."""
    for field in dataclasses.fields(instance):
        allowed = field.metadata.get("choices")
        if allowed is not None and getattr(instance, field.name) not in allowed:
            raise ValueError(f"{field.name} must be one of {allowed}, got {getattr(instance, field.name)!r}.")


def value_type(annotation: Any) -> type:
    """int for `int | None`, Path for `Path | None`, and so on: what argparse converts a flag's text with."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    return annotation if annotation in (int, float, str, bool, Path) else str


def add_fields(
    parser: argparse.ArgumentParser, cls: type, names: tuple[str, ...] | None = None, prefix: str = ""
) -> None:
    """One flag per `option` field of `cls` (or of those in `names`), with the field's default, choices and help;
    `prefix` (e.g. "reconstruction_") goes before each flag's name and destination."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if "help" not in field.metadata or (names is not None and field.name not in names):
            continue
        flags = (f"--{(prefix + field.name).replace('_', '-')}", *field.metadata["flags"])
        kind, help_text = value_type(hints[field.name]), field.metadata["help"].replace("%", "%%")
        if kind is bool:  # --name and --no-name: a default of True can be turned off too
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=field.default, help=help_text)
            continue
        choices, many = field.metadata["choices"], typing.get_origin(hints[field.name]) is tuple
        if many:  # tuple[X, ...]: any number of values after the flag, kept as a tuple
            kind = typing.get_args(hints[field.name])[0]
        parser.add_argument(*flags, type=kind, default=field.default, choices=choices, help=help_text,
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
        check_choices(self)
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
