"""What a killed `egmla convert --stream` resumes from, in its work folder beside OUT (`.OUT.resume`): the split
search's choice, the statistics it saved a layer at a time, each converted layer's shard, and after each layer the
residual streams entering the next one (the calibration blocks', the layer-wise fit's and the held-out documents').
Each file is written whole or not at all, so a run killed at any moment resumes after its last finished layer."""

import dataclasses
import json
from pathlib import Path

import torch

from ..outputs import replace_atomically
from .convert import ConversionOptions

SEARCH_FILE, PROGRESS_FILE = "search.json", "progress.pt"


@dataclasses.dataclass(frozen=True)
class StreamWork:
    """A streamed conversion's work folder; `None` where a method finds nothing saved yet."""

    folder: Path

    @property
    def statistics(self) -> Path:
        return self.folder / "statistics"

    @property
    def shards(self) -> Path:
        return self.folder / "layers"

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

    def saved_progress(self) -> dict | None:
        """What `save_progress` wrote after the last finished layer."""
        path = self.folder / PROGRESS_FILE
        return torch.load(path, weights_only=True) if path.is_file() else None

    def save_progress(self, progress: dict) -> None:
        """`progress` (tensors, lists, dicts and numbers) after a layer whose shard is already in `shards`."""
        replace_atomically(self.folder / PROGRESS_FILE, lambda path: torch.save(progress, path))
