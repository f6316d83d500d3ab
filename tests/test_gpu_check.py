"""benchmarks/gpu/gpu_check.py, the prepared GPU check, run with --tiny shapes on the CPU so that it cannot rot: every
section produces its rows, and every decode path equals the reference (Triton in its interpreter)."""

import importlib.util
import json
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", BENCHMARKS / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_check_runs_every_section_on_tiny_shapes(tmp_path):
    gpu_check = load_gpu_check()
    gpu_check.main(["--tiny", "--out", str(tmp_path), "--seeds", "2"])
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = results["sections"]
    assert list(sections) == ["decode errors", "decode speed", "paper figure", "conversion"]
    for name, section in sections.items():
        assert section["rows"] and not any("error" in row for row in section["rows"]), (name, section["rows"])

    errors = sections["decode errors"]["rows"]
    assert {row["implementation"] for row in errors} == set(gpu_check.PATHS)
    assert {row["path"] for row in errors} >= {"Triton K/V kernel", "Triton latent kernel", "blocked re-expansion",
                                               "absorbed, SDPA over cached rows"}  # fmt: skip
    assert all(row["within_tolerance"] for row in errors), errors
    assert max(row["relative_error"] for row in errors if row["dtype"] == "float32") < 1e-5

    speed = sections["decode speed"]["rows"]
    assert {(row["model"], row["cache"]) for row in speed} == {(m, c) for m in ("source", "converted")
                                                              for c in ("dynamic", "static")}  # fmt: skip
    assert all(row["ms_per_step"] > 0 and row["bytes_read"] > 0 for row in speed)

    figure = sections["paper figure"]["rows"]
    assert len(figure) == 4 and len({row["steps"] for row in figure}) == 1  # the same steps for every variant
    assert all(len(row["held_out_losses"]) == 2 for row in figure)
    bytes_per_token = {row["variant"]: row["kv_bytes_per_token_bf16"] for row in figure}
    assert bytes_per_token["MLA r32"] > bytes_per_token["MLA r8"] == bytes_per_token["EG-MLA r8, gate on K/V"]

    (conversion,) = sections["conversion"]["rows"]
    assert conversion["stage_seconds"]["load"] >= 0 and conversion["held_out_perplexity"]["source"] > 1
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert markdown.count("\n## ") == 4 and "Triton K/V kernel" in markdown
