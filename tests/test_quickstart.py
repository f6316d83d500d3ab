"""The README's main job, in a quick mode: train a few steps, measure caches, save, reload as remote code."""

import json

import pytest

from egmla.cli import main
from tests.utils import STORIES260K, TINYSTORIES, needs_shared


def test_quickstart_quick_mode(tmp_path, capsys):
    out = tmp_path / "run"
    main(["quickstart", "--out", str(out), "--steps", "12", "--batch-size", "4", "--block-size", "64"])
    report = json.loads((out / "quickstart_report.json").read_text())
    assert report["held_out_loss_after"] < report["held_out_loss_before"]
    cache = report["cache_bytes_per_token"]
    # Measured on real caches, fp32, 4 layers: Llama 2*128 values/layer; MLA 64+16; EG-MLA 16+16 plus an int64 id.
    assert cache == {"llama_mha": 4 * 2 * 128 * 4, "mla": 4 * (64 + 16) * 4, "egmla": 4 * (16 + 16) * 4 + 8}
    assert {"config.json", "model.safetensors", "modeling_egmla.py", "configuration_egmla.py", "tokenizer.json"} <= {
        path.name for path in out.iterdir()
    }
    printed = capsys.readouterr().out
    assert "trust_remote_code reload generates the same: True" in printed

    with pytest.raises(SystemExit, match="exists"):
        main(["quickstart", "--out", str(out), "--steps", "1"])


def test_quickstart_on_the_shared_text_and_tokenizer(tmp_path):
    needs_shared(TINYSTORIES)
    out = tmp_path / "run"
    main(
        [
            "quickstart",
            "--out",
            str(out),
            "--train-text",
            str(TINYSTORIES),
            "--tokenizer",
            str(STORIES260K),
            "--steps",
            "6",
            "--batch-size",
            "4",
            "--block-size",
            "64",
        ]
    )
    assert json.loads((out / "quickstart_report.json").read_text())["steps"] == 6
