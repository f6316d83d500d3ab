"""lm-evaluation-harness loads a converted folder (remote code) and scores the local tasks of examples/lm_eval."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from egmla.conversion import ConversionOptions, convert_llama_to_egmla, load_llama
from tests.utils import STORIES260K, needs_shared

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install -e '.[eval]')")

REPOSITORY = Path(__file__).resolve().parents[1]
TASKS = "tinystories_ppl,tinystories_cloze"


def lm_eval_results(model_folder: Path, output: Path) -> dict:
    """Runs the documented command in a fresh process (no egmla imported there) and reads its results."""
    command = [
        sys.executable, "-m", "lm_eval", "--model", "hf",
        "--model_args", f"pretrained={model_folder},trust_remote_code=True",
        "--tasks", TASKS, "--include_path", "examples/lm_eval",
        "--device", "cpu", "--batch_size", "8", "--limit", "24", "--output_path", str(output),
    ]  # fmt: skip
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    environment["HF_DATASETS_CACHE"] = str(output / "datasets")
    finished = subprocess.run(command, cwd=REPOSITORY, env=environment, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    (results_file,) = output.rglob("results_*.json")
    return json.loads(results_file.read_text())["results"]


def test_a_converted_folder_evaluates_like_its_source(tmp_path):
    """At full latent rank with every rope pair kept the conversion is exact, so lm-eval must score it as the
    source; this runs the whole path: remote code, tokenizer, rolling loglikelihood and multiple choice."""
    needs_shared(STORIES260K)
    teacher = load_llama(STORIES260K)
    key_value_heads, head_dim = teacher.config.num_key_value_heads, teacher.config.head_dim
    student = convert_llama_to_egmla(
        teacher,
        ConversionOptions(
            kv_lora_rank=2 * key_value_heads * head_dim,
            rope_pairs=key_value_heads * head_dim // 2,
            gate_embedding_dim=8,
        ),
        torch.randint(3, 500, (2, 64), generator=torch.Generator().manual_seed(0)),
    )
    student.save_pretrained(tmp_path / "converted")
    AutoTokenizer.from_pretrained(STORIES260K).save_pretrained(tmp_path / "converted")
    assert (tmp_path / "converted" / "modeling_egmla.py").exists()

    source = lm_eval_results(STORIES260K, tmp_path / "source-results")
    converted = lm_eval_results(tmp_path / "converted", tmp_path / "converted-results")
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        assert converted["tinystories_ppl"][metric] == pytest.approx(source["tinystories_ppl"][metric], rel=1e-4)
    for metric in ("acc,none", "acc_norm,none"):
        assert 0.0 <= converted["tinystories_cloze"][metric] <= 1.0
        assert converted["tinystories_cloze"][metric] == pytest.approx(source["tinystories_cloze"][metric], abs=1e-9)
