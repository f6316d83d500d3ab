"""Writing output folders atomically: a run that stops half-way leaves no half-written folder behind."""

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def check_output_folder(out: str | Path, overwrite: bool) -> Path:
    """Refuses an existing folder unless `overwrite`: call it before any long work starts."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it.")
    return out


@contextmanager
def atomic_folder(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yields a temporary folder beside `out`; on success it replaces `out` by a rename, on error it is removed."""
    out = check_output_folder(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
