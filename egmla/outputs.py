"""Writing output folders atomically: a run that stops half-way leaves no half-written folder behind."""

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def check_output_folder(out: str | Path, overwrite: bool, inputs: tuple[str | Path, ...] = ()) -> Path:
    """Refuses an existing folder unless `overwrite`, and any output that is, holds or lies inside one of the
    `inputs` (even with `overwrite`): call it before any long work starts."""
    out = Path(out)
    resolved = out.resolve()
    for source in inputs:
        source_path = Path(source).resolve()
        if not Path(source).exists():
            continue  # a Hub id, not a local path
        if resolved == source_path or resolved in source_path.parents or source_path in resolved.parents:
            raise ValueError(f"The output {out} overlaps the input {source}: choose another folder.")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it.")
    return out


def remove_stale_staging(out: Path) -> None:
    """Removes the staging folders of earlier runs for `out` that were killed (their writer's pid is gone)."""
    for staging in out.parent.glob(f".{out.name}.*"):
        pid = staging.name.removeprefix(f".{out.name}.").split(".")[0]
        if staging.is_dir() and pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


@contextmanager
def atomic_folder(out: str | Path, overwrite: bool = False, inputs: tuple[str | Path, ...] = ()) -> Iterator[Path]:
    """Yields a temporary folder beside `out` (`.OUT.<pid>.<random>`); on success it replaces `out` by renames, on
    error it is removed. A run killed outright (SIGKILL) leaves only that folder, which the next run removes: `out`
    is never partial, since both the old folder and the new one move by atomic renames."""
    out = check_output_folder(out, overwrite, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp's 0o700 would otherwise become the output's mode
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replaced = None
    if out.exists():  # moved aside, not deleted in place: a kill mid-delete would leave a partial `out`
        replaced = staging.with_name(staging.name + ".replaced")
        out.rename(replaced)
    staging.rename(out)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
