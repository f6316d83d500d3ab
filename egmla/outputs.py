"""Writing output folders atomically: a run that stops half-way leaves no half-written folder behind."""

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


@contextmanager
def atomic_folder(out: str | Path, overwrite: bool = False, inputs: tuple[str | Path, ...] = ()) -> Iterator[Path]:
    """Yields a temporary folder beside `out`; on success it replaces `out` by a rename, on error it is removed."""
    out = check_output_folder(out, overwrite, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp's 0o700 would otherwise become the output's mode
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
