"""Options declared once: a dataclass field made with `option` carries its help text, its choices and any older
flag spellings, and `add_fields` turns such fields into command-line flags (`--field-name`) with the dataclass's
default, so that the CLI, the dataclasses and their validation read the same declaration."""

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any


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
        choices = field.metadata["choices"]
        parser.add_argument(*flags, type=kind, default=field.default, choices=choices, help=help_text)
