"""Wall time per stage of a conversion, for its report (what the slowest stage is, on the machine it ran on)."""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class StageTimes:
    """Seconds per named stage, in the order the stages first ran (a stage timed twice adds up)."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - started, 1)
