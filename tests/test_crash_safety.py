"""Killed outright (SIGKILL: no cleanup runs), the long jobs lose nothing: `egmla convert` never leaves a partial
output and never touches its source; `egmla finetune` resumes to the losses of an uninterrupted run."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from egmla.outputs import STAGING_MARK, check_output_folder
from tests.utils import FAST, llama_folder, tiny_model
from tests.utils import folder_digest as digest

EGMLA = [sys.executable, "-m", "egmla.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
OUTPUT_FILES = {"config.json", "model.safetensors", "modeling_egmla.py", "tokenizer.json", "conversion_report.json"}

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")


def killed_after(command: list[str], seconds: float, cwd: Path) -> None:
    process = subprocess.Popen(command, cwd=cwd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        process.wait()


def assert_complete(out: Path) -> None:
    assert OUTPUT_FILES <= {path.name for path in out.iterdir()}, sorted(path.name for path in out.iterdir())
    assert load_file(out / "model.safetensors")  # whole, readable


def test_a_killed_convert_leaves_no_partial_output_and_the_next_run_clears_its_staging(tmp_path):
    source = llama_folder(tmp_path / "src")
    before = digest(source)
    out = tmp_path / "out"
    command = [*EGMLA, "convert", str(source), "--out", str(out), *FAST, "--overwrite"]
    started = time.monotonic()
    subprocess.run(command, cwd=tmp_path, env=ENV, check=True, capture_output=True)
    duration = time.monotonic() - started
    assert_complete(out)
    moments = random.Random(0)
    for _ in range(3):  # killed at random moments of a run that replaces `out`: before, during or after the swap
        killed_after(command, moments.uniform(0.2, duration), tmp_path)
        if out.exists():
            assert_complete(out)  # the old folder or the new one, never a mix
        assert digest(source) == before
        leftovers = [path.name for path in tmp_path.iterdir() if path.name.startswith(".out.")]
        assert all(name.split(".")[2].isdigit() for name in leftovers), leftovers  # named by the killed run's pid
    subprocess.run(command, cwd=tmp_path, env=ENV, check=True, capture_output=True)
    assert_complete(out)
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".out.")] == []
    assert digest(source) == before


def finetune_command(tmp_path: Path, student: Path, source: Path, text: Path) -> list[str]:
    return [*EGMLA, "finetune", str(student), "--teacher", str(source), "--out", str(tmp_path / "tuned"),
            "--checkpoint-dir", str(tmp_path / "checkpoints"), "--train-text", str(text), "--block-size", "32",
            "--steps", "16", "--batch-size", "2", "--save-every", "1", "--eval-every", "0", "--warmup-steps", "2"]  # fmt: skip


def history(checkpoints: Path) -> list[float]:
    return [entry["loss"] for entry in json.loads((checkpoints / "last" / "progress.json").read_text())["history"]]


def saved_step(checkpoints: Path) -> int:
    try:
        return json.loads((checkpoints / "last" / "progress.json").read_text())["step"]
    except (OSError, ValueError):  # between the renames of a checkpoint swap
        return -1


def kill_when(command: list[str], condition) -> bool:
    """Runs `command` and kills it (SIGKILL) as soon as `condition()` holds; False if it finished first."""
    process = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not condition():
        if process.poll() is not None:
            return False
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.wait()
    return True


def test_a_killed_finetune_resumes_to_the_losses_of_an_uninterrupted_run(tmp_path):
    source = llama_folder(tmp_path / "src")
    student = tmp_path / "student"
    # shaped as its source (a conversion keeps the widths, the vocabulary and the MLP)
    tiny_model(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4).save_pretrained(student)
    text = tmp_path / "text.txt"
    text.write_text("\n<|endoftext|>\n".join(f"Story {i}: the cat sat on the mat and ran far away." for i in range(80)))
    straight_dir, killed_dir = tmp_path / "straight", tmp_path / "killed"
    straight_dir.mkdir(), killed_dir.mkdir()
    subprocess.run(finetune_command(straight_dir, student, source, text), env=ENV, check=True, capture_output=True)
    expected = history(straight_dir / "checkpoints")
    assert len(expected) == 16

    command = finetune_command(killed_dir, student, source, text)
    checkpoints = killed_dir / "checkpoints"
    # Killed mid-checkpoint (a new one being written beside the last), then twice more while resumed runs train.
    assert kill_when(command, lambda: (checkpoints / "last.saving").exists() and saved_step(checkpoints) >= 2)
    assert not (killed_dir / "tuned").exists() and 2 <= saved_step(checkpoints) < 16  # it landed mid-run
    for _ in range(2):
        reached = saved_step(checkpoints)
        assert kill_when([*command, "--resume"], lambda reached=reached: saved_step(checkpoints) >= reached + 3)
        assert reached + 3 <= saved_step(checkpoints) < 16 and not (killed_dir / "tuned").exists()
    subprocess.run([*command, "--resume", "--overwrite"], env=ENV, check=True, capture_output=True)
    assert history(checkpoints) == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert (killed_dir / "tuned" / "model.safetensors").exists()


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_run_killed_between_the_two_renames_gets_the_old_output_back(tmp_path):
    """A kill after the old OUT moved aside and before the new one moved in leaves no OUT: the next run puts the
    old one back (so it refuses to overwrite it without --overwrite) and removes the dead run's staging folder; a
    user's folder of a similar name, and another machine's staging folder, are left alone."""
    out, pid = tmp_path / "out", dead_pid()
    folders = {
        "replaced": (tmp_path / f".out.{pid}.abcd1234.replaced", socket.gethostname()),
        "staging": (tmp_path / f".out.{pid}.abcd1234", socket.gethostname()),
        "users": (tmp_path / ".out.2024", None),
        "other host": (tmp_path / f".out.{pid}.zzzz9999", "another-machine"),
    }
    for name, (folder, host) in folders.items():
        folder.mkdir()
        (folder / "content.txt").write_text(name)
        if host is not None:
            (folder / STAGING_MARK).write_text(host)
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        check_output_folder(out, overwrite=False)
    assert (out / "content.txt").read_text() == "replaced" and not (out / STAGING_MARK).exists()
    assert not folders["staging"][0].exists() and not folders["replaced"][0].exists()
    assert folders["users"][0].exists() and folders["other host"][0].exists()


def layers_fitted(work: Path) -> int:
    return len(list((work / "layers").glob("layer-*.safetensors")))


def test_a_killed_conversion_resumes_to_the_result_of_an_uninterrupted_run(tmp_path):
    """Killed in the layer-wise fit, in the recovery, and after the recovery's last step (each kill confirmed to
    have landed there), `--resume` continues from the last fitted layer or checkpoint: the saved model equals an
    uninterrupted run's."""
    source = llama_folder(tmp_path / "src", num_hidden_layers=4)
    text = tmp_path / "text.txt"
    text.write_text("\n<|endoftext|>\n".join(f"Story {i}: the cat sat on the mat and ran far away." for i in range(80)))
    flags = ["--kv-lora-rank", "16", "--rope-split", "exact", "--calibration-blocks", "8", "--block-size", "32",
             "--reconstruction-steps", "300", "--train-text", str(text), "--source-sample-share", "0",
             "--held-aside-samples", "0", "--eval-documents", "2", "--extra-eval-text", "--steps", "12",
             "--batch-size", "2", "--save-every", "1", "--eval-every", "0"]  # fmt: skip
    straight = tmp_path / "straight"
    subprocess.run([*EGMLA, "convert", str(source), "--out", str(straight), *flags], env=ENV, check=True)
    out, work = tmp_path / "out", tmp_path / ".out.resume"
    command = [*EGMLA, "convert", str(source), "--out", str(out), *flags]
    recovery = work / "recovery"

    assert kill_when(command, lambda: layers_fitted(work) >= 1)
    assert 1 <= layers_fitted(work) < 4 and not recovery.exists()  # mid-way through the layer-wise fit
    assert kill_when([*command, "--resume"], lambda: saved_step(recovery) >= 2)
    assert layers_fitted(work) == 4 and 2 <= saved_step(recovery) < 12  # mid-way through the recovery
    assert kill_when([*command, "--resume"], lambda: saved_step(recovery) == 12)
    assert not out.exists()  # after the recovery's last step, before the output was saved
    subprocess.run([*command, "--resume"], env=ENV, check=True)
    assert not work.exists()
    expected, resumed = load_file(straight / "model.safetensors"), load_file(out / "model.safetensors")
    assert expected.keys() == resumed.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def statistics_saved(work: Path) -> int:
    return len(list((work / "statistics").glob("layer-*.pt")))


def layers_streamed(work: Path) -> int:
    try:
        return len(torch.load(work / "progress.pt", weights_only=True)["frequencies"])
    except (OSError, RuntimeError, EOFError):  # none yet, or caught mid-rename
        return 0


def test_a_killed_streamed_conversion_resumes_to_the_result_of_an_uninterrupted_run(tmp_path):
    """`--stream` killed in the split search's pass, in the conversion's pass over the layers, and once more after it
    resumed (each kill confirmed to have landed there): `--resume` continues after the last finished layer (the
    search done once), and the saved model and its held-out scores equal an uninterrupted run's."""
    source = llama_folder(tmp_path / "src", num_hidden_layers=6)
    text = tmp_path / "text.txt"
    text.write_text("\n<|endoftext|>\n".join(f"Story {i}: the cat sat on the mat and ran far away." for i in range(80)))
    flags = ["--stream", "--kv-lora-rank", "16", "--calibration-blocks", "8", "--block-size", "32",
             "--reconstruction-steps", "150", "--train-text", str(text), "--eval-documents", "4"]  # fmt: skip
    straight = tmp_path / "straight"
    subprocess.run([*EGMLA, "convert", str(source), "--out", str(straight), *flags], env=ENV, check=True)
    out, work = tmp_path / "out", tmp_path / ".out.resume"
    command = [*EGMLA, "convert", str(source), "--out", str(out), *flags]

    assert kill_when(command, lambda: statistics_saved(work) >= 2)
    assert not (work / "search.json").exists() and layers_streamed(work) == 0  # mid-way through the search
    assert kill_when([*command, "--resume"], lambda: layers_streamed(work) >= 2)
    assert (work / "search.json").exists() and 2 <= layers_streamed(work) < 6  # mid-way through the layers
    reached = layers_streamed(work)
    assert kill_when([*command, "--resume"], lambda: layers_streamed(work) > reached)
    assert reached < layers_streamed(work) < 6 and not out.exists()
    subprocess.run([*command, "--resume"], env=ENV, check=True)
    assert not work.exists()
    for shard in sorted(path.name for path in straight.glob("*.safetensors")):
        expected, resumed = load_file(straight / shard), load_file(out / shard)
        assert expected.keys() == resumed.keys()
        for name, tensor in expected.items():
            torch.testing.assert_close(resumed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    reports = [json.loads((folder / "conversion_report.json").read_text()) for folder in (straight, out)]
    assert reports[1]["perplexity"] == pytest.approx(reports[0]["perplexity"], rel=1e-5)
    assert reports[1]["candidates"] == reports[0]["candidates"]
    assert reports[1]["reconstruction"]["layers"] == reports[0]["reconstruction"]["layers"]
