"""Writing output folders atomically: a run that stops half-way, even killed outright, leaves no half-written
folder behind."""

import json
import math
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

# Beside OUT, a run writes `.OUT.<pid>.<8 random>` (and moves an old OUT to that name + ".replaced"), each marked by
# STAGING_MARK holding the writer's host, so that only what this machine's dead writers left is ever touched.
STAGING_MARK = ".egmla-staging"


def non_finite(value: object) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def is_number(value: object) -> bool:
    """A finite int or float: what a card may show as a score."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def finite(value: object) -> object:
    """`value` with each NaN or infinite number replaced by None (JSON's null: no score to show), at any depth; what
    strict JSON and a model card can hold."""
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return None if non_finite(value) else value


def report_json(report: dict) -> str:
    """A report as strict JSON (no NaN or Infinity, which JSON does not have)."""
    return json.dumps(finite(report), indent=2, allow_nan=False) + "\n"


def check_output_folder(out: str | Path, overwrite: bool, inputs: tuple[str | Path, ...] = ()) -> Path:
    """Refuses an existing folder unless `overwrite`, and any output that is, holds or lies inside one of the
    `inputs` (even with `overwrite`): call it before any long work starts. First puts back what a killed run left
    (`recover_killed_runs`)."""
    out = Path(out)
    resolved = out.resolve()
    for source in inputs:
        source_path = Path(source).resolve()
        if not Path(source).exists():
            continue  # a Hub id, not a local path
        if resolved == source_path or resolved in source_path.parents or source_path in resolved.parents:
            raise ValueError(f"The output {out} overlaps the input {source}: choose another folder.")
    recover_killed_runs(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it.")
    return out


def recover_killed_runs(out: Path) -> None:
    """For the folders that runs killed outright (SIGKILL) left beside `out`: the old `out` moved aside goes back
    when `out` is missing (a kill between the two renames of the swap); every other one is removed."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(\d+)\.[a-z0-9_]{{8}}(\.replaced)?")
    candidates = sorted(out.parent.glob(f".{out.name}.*"), key=lambda path: not path.name.endswith(".replaced"))
    for folder in candidates:
        match = pattern.fullmatch(folder.name)
        mark = folder / STAGING_MARK
        if not match or not mark.is_file() or mark.read_text() != socket.gethostname():
            continue  # not ours: a user's folder, or another machine's run on a shared disk
        if process_alive(int(match.group(1))):
            continue
        if match.group(2) and not out.exists():
            mark.unlink()
            folder.rename(out)
        else:
            shutil.rmtree(folder, ignore_errors=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def replace_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """`write(partial_path)`, then the partial file renamed over `path`: the file is whole or absent."""
    partial = path.with_name(path.name + ".partial")
    write(partial)
    os.replace(partial, path)


@contextmanager
def atomic_folder(out: str | Path, overwrite: bool = False, inputs: tuple[str | Path, ...] = ()) -> Iterator[Path]:
    """Yields a temporary folder beside `out` (`.OUT.<pid>.<random>`); on success it replaces `out` by renames, on
    error it is removed. `out` is never partial (the old folder and the new one both move by atomic renames); a run
    killed outright (SIGKILL) leaves only its staging folder, which the next run removes, or, killed between the two
    renames, the old `out` moved aside, which the next run puts back (`recover_killed_runs`)."""
    out = check_output_folder(out, overwrite, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp's 0o700 would otherwise become the output's mode
    (staging / STAGING_MARK).write_text(socket.gethostname())
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replaced = None
    if out.exists():  # moved aside, not deleted in place: a kill mid-delete would leave a partial `out`
        replaced = staging.with_name(staging.name + ".replaced")
        (out / STAGING_MARK).write_text(socket.gethostname())
        out.rename(replaced)
    (staging / STAGING_MARK).unlink()
    staging.rename(out)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
