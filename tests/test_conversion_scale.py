"""benchmarks/conversion/conversion_scale.py on its 2-layer tiny shape: a random-weight Llama written, converted with
the defaults' stages in a child process, and its row (wall time, seconds by stage from the report, peak RSS from the
OS)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "conversion"))
import conversion_scale  # noqa: E402

from egmla.data import EXCERPT  # noqa: E402

QUICK = ["--calibration-blocks", "8", "--eval-documents", "4", "--reconstruction-steps", "2", "--steps", "1",
         "--sampled-blocks", "8", "--held-aside-samples", "3"]  # fmt: skip


def test_the_scale_benchmark_reports_stage_times_and_peak_memory(tmp_path, capsys):
    (row,) = conversion_scale.main(
        [
            "--shapes",
            "tiny",
            "--text",
            str(EXCERPT),
            "--json",
            str(tmp_path / "rows.json"),
            "--log",
            str(tmp_path / "log"),
        ]
        + ["--", *QUICK]
    )
    assert row["shape"] == "tiny" and row["checkpoint_gb"] > 0
    assert 0.1 < row["peak_rss_gb"] < 8  # the child's own peak, read from wait4
    stages = row["stage_seconds"]
    assert {"load", "split search", "factorization", "layer-wise fit", "recovery", "scoring"} <= set(stages)
    assert sum(stages.values()) <= row["wall_s"]
    assert "| tiny |" in capsys.readouterr().out and (tmp_path / "rows.json").exists()
    assert "saved " in (tmp_path / "log").read_text()  # the child's own output, kept with --log
