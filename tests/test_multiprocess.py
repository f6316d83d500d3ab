"""`egmla finetune` under `accelerate launch` with 2 CPU processes (gloo) equals 1 process accumulating gradients
over the same samples."""

import json
import os
import subprocess
import sys
from pathlib import Path

from egmla.cli import main
from tests.utils import STORIES260K, TINYSTORIES, needs_shared

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "accelerate" / "cpu_2_processes.yaml"


def finetune_args(student: Path, out: Path, checkpoints: Path, grad_accum: int) -> list[str]:
    return [
        "finetune",
        str(student),
        "--teacher",
        str(STORIES260K),
        "--train-text",
        str(TINYSTORIES),
        "--out",
        str(out),
        "--checkpoint-dir",
        str(checkpoints),
        "--steps",
        "5",
        "--batch-size",
        "2",
        "--gradient-accumulation-steps",
        str(grad_accum),
        "--block-size",
        "64",
        "--eval-blocks",
        "4",
        "--eval-documents",
        "4",
        "--eval-every",
        "0",
        "--save-every",
        "0",
        "--learning-rate",
        "3e-3",
        "--ce-weight",
        "0.5",
    ]


def losses(checkpoints: Path) -> list[float]:
    history = json.loads((checkpoints / "last" / "progress.json").read_text())["history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def test_two_processes_equal_one_process_with_gradient_accumulation(tmp_path):
    needs_shared(STORIES260K)
    needs_shared(TINYSTORIES)
    student = tmp_path / "student"
    main(["convert", str(STORIES260K), "--out", str(student), "--kv-cut", "0.5", "--rope-pairs", "3", "--gate-embedding-dim", "8",
          "--train-text", str(TINYSTORIES), "--calibration-blocks", "4", "--block-size", "64", "--eval-documents", "8",
          "--steps", "0", "--reconstruction-steps", "0", "--source-sample-share", "0",
          "--held-aside-samples", "0"])  # fmt: skip

    main(finetune_args(student, tmp_path / "one", tmp_path / "one.checkpoints", grad_accum=2))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG), "-m", "egmla.cli"]
    result = subprocess.run(
        command + finetune_args(student, tmp_path / "two", tmp_path / "two.checkpoints", grad_accum=1),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"},
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = losses(tmp_path / "one.checkpoints"), losses(tmp_path / "two.checkpoints")
    assert len(one) == len(two) == 5
    assert max(abs(a - b) for a, b in zip(one, two, strict=True)) <= 1e-4, (one, two)
    assert len({round(loss, 4) for loss in one}) == 5  # the weights moved: each step saw a different model
    # One process wrote the output folder, whole.
    assert (tmp_path / "two" / "finetune_report.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".two")]


def test_the_shipped_accelerate_configs_load():
    from accelerate.commands.config.config_args import load_config_from_file

    from egmla import EGMLAForCausalLM

    folder = CONFIG.parent
    assert load_config_from_file(str(folder / "ddp.yaml")).distributed_type == "MULTI_GPU"
    fsdp = load_config_from_file(str(folder / "fsdp.yaml"))
    assert fsdp.distributed_type == "FSDP"
    # FSDP wraps each decoder layer: the class the config names must be the model's unit that is never split.
    assert fsdp.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] in EGMLAForCausalLM._no_split_modules
