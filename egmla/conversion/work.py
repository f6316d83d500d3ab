"""What a killed conversion resumes from, in its work folder beside OUT (`.OUT.resume`), and the check that a resumed
run is the same job: the split search's choice, the statistics it saved a layer at a time, each layer the layer pass
finished, after each layer the streams entering the next one, and the recovery's checkpoints. Each file is written
whole or not at all, so a run killed at any moment resumes after its last finished step."""

import dataclasses
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..outputs import replace_atomically
from .calibration import LayerStatistics
from .convert import ConversionOptions

if TYPE_CHECKING:
    from . import pipeline

SEARCH_FILE, RANKS_FILE, PROGRESS_FILE = "search.json", "ranks.json", "progress.pt"


@dataclasses.dataclass(frozen=True)
class WorkFolder:
    """A conversion's work folder, as the layer pass reads and writes it; `None` where a method finds nothing saved
    yet."""

    folder: Path

    @property
    def statistics(self) -> Path:
        return self.folder / "statistics"

    @property
    def shards(self) -> Path:
        return self.folder / "layers"

    def save_statistics(self, layer_idx: int, statistics: LayerStatistics) -> None:
        """One layer's calibration statistics, as the split search's pass leaves them for the conversion's."""
        path = self.statistics / f"layer-{layer_idx:05d}.pt"
        replace_atomically(path, lambda partial: torch.save(dataclasses.asdict(statistics), partial))

    def load_statistics(self, layer_idx: int) -> LayerStatistics:
        return LayerStatistics(**torch.load(self.statistics / f"layer-{layer_idx:05d}.pt", weights_only=True))

    def saved_search(self) -> tuple[ConversionOptions, list[dict]] | None:
        """The split search's chosen options and its rows, once it finished."""
        path = self.folder / SEARCH_FILE
        if not path.is_file():
            return None
        saved = json.loads(path.read_text())
        return ConversionOptions(**saved["options"]), saved["candidates"]

    def save_search(self, options: ConversionOptions, candidates: list[dict]) -> None:
        text = json.dumps({"options": dataclasses.asdict(options), "candidates": candidates}, indent=2)
        replace_atomically(self.folder / SEARCH_FILE, lambda path: path.write_text(text))

    def saved_ranks(self) -> list[int] | None:
        """Each layer's latent width, once the pass has set them."""
        path = self.folder / RANKS_FILE
        return json.loads(path.read_text()) if path.is_file() else None

    def save_ranks(self, ranks: list[int]) -> None:
        replace_atomically(self.folder / RANKS_FILE, lambda path: path.write_text(json.dumps(ranks)))

    def saved_progress(self) -> dict | None:
        """What `save_progress` wrote after the last finished layer."""
        path = self.folder / PROGRESS_FILE
        return torch.load(path, weights_only=True) if path.is_file() else None

    def save_progress(self, progress: dict) -> None:
        """`progress` (tensors, lists, dicts and numbers) after a layer whose shard is already in `shards`."""
        replace_atomically(self.folder / PROGRESS_FILE, lambda path: torch.save(progress, path))


JOB_FILE = "job.json"
JOB_DEFAULTS = {"stream": False}


def work_folder(out: str | Path) -> Path:
    """Where a conversion keeps what a killed run resumes from (fitted layers, recovery checkpoints): beside OUT."""
    out = Path(out)
    return out.with_name(f".{out.name}.resume")


def job_description(job: "pipeline.ConversionJob") -> dict:
    """What makes two runs the same job: a resumed run must not mix its work with another job's."""
    fields = ("source", "options", "text", "reconstruction", "finetune", "placement", "stream")
    return json.loads(json.dumps({name: getattr(job, name) for name in fields}, default=json_default))


def json_default(value: object) -> object:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else str(value)


def check_resumable(job: "pipeline.ConversionJob") -> None:
    """A killed run of this very job to resume, or an error naming what is missing or different."""
    if not (job.work / JOB_FILE).is_file():
        raise ValueError(
            f"--resume: there is no killed run of {job.out} to resume ({job.work} does not exist); leave --resume out "
            "to start from the beginning."
        )
    saved, described = json.loads((job.work / JOB_FILE).read_text()), job_description(job)
    # A work folder written before a field existed holds that field's default.
    changed = sorted(name for name in described if saved.get(name, JOB_DEFAULTS.get(name)) != described[name])
    if changed:
        raise ValueError(
            f"--resume: the killed run in {job.work} was another job (its {', '.join(changed)} differ); give the same "
            "source and options, or leave --resume out to start again."
        )


def start_work(job: "pipeline.ConversionJob") -> Path | None:
    """The job's work folder: kept as it is to resume it (checked when the job was built), else started empty; None
    when the job keeps no work, so there is nothing to resume."""
    work = job.work
    if not job.keeps_work:
        return None
    if job.resume:
        return work
    if work.exists():
        print(f"starting again: the work of a killed run in {work} is discarded (--resume would continue it)")
        shutil.rmtree(work)
    work.mkdir(parents=True)
    (work / JOB_FILE).write_text(json.dumps(job_description(job), indent=2))
    return work
