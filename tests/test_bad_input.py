"""The README's bad-input table, row by row: each bad input gets an error that names the problem (and what to do),
nothing is written, and the source is left as it was."""

import shutil
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

from egmla.cli import main
from tests.utils import (
    FAST,
    STORIES260K,
    llama_folder,
    tiny_llama,
    tiny_model,
    tiny_source,
    tiny_values,
    with_tokenizer,
)
from tests.utils import folder_digest as digest


def not_a_llama(tmp: Path) -> tuple[Path, list[str]]:
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=512)).save_pretrained(tmp / "src")
    return with_tokenizer(tmp / "src"), FAST


def mistral_with_a_short_window(tmp: Path) -> tuple[Path, list[str]]:
    tiny_source("mistral", vocab_size=512, sliding_window=32).save_pretrained(tmp / "src")
    return with_tokenizer(tmp / "src"), FAST


def a_qk_norm_model(tmp: Path) -> tuple[Path, list[str]]:
    Qwen3ForCausalLM(Qwen3Config(**tiny_values(vocab_size=512))).save_pretrained(tmp / "src")
    return with_tokenizer(tmp / "src"), FAST


def missing_weights(tmp: Path) -> tuple[Path, list[str]]:
    source = llama_folder(tmp / "src")
    (source / "model.safetensors").unlink()
    return source, FAST


def corrupt_weights(tmp: Path) -> tuple[Path, list[str]]:
    source = llama_folder(tmp / "src")
    (source / "model.safetensors").write_bytes(b"not a safetensors file" * 50)
    return source, FAST


def missing_tokenizer(tmp: Path) -> tuple[Path, list[str]]:
    tiny_llama(vocab_size=512).save_pretrained(tmp / "src")
    return tmp / "src", FAST


def text_file(tmp: Path, text: str) -> Path:
    (tmp / "text.txt").write_text(text)
    return tmp / "text.txt"


def empty_text(tmp: Path) -> tuple[Path, list[str]]:
    return llama_folder(tmp / "src"), [*FAST, "--train-text", str(text_file(tmp, ""))]


def text_shorter_than_a_block(tmp: Path) -> tuple[Path, list[str]]:
    text = text_file(tmp, "\n<|endoftext|>\n".join(["Hi."] * 3))
    return llama_folder(tmp / "src"), [*FAST, "--train-text", str(text)]


def kv_cut_outside(tmp: Path) -> tuple[Path, list[str]]:
    return llama_folder(tmp / "src"), ["--kv-cut", "1.5"]


def kv_cut_leaving_no_latent(tmp: Path) -> tuple[Path, list[str]]:
    return llama_folder(tmp / "src"), ["--kv-cut", "0.99", "--rope-mode", "decoupled", "--calibration-blocks", "4",
                                       "--block-size", "32"]  # fmt: skip


def rank_too_large(tmp: Path) -> tuple[Path, list[str]]:
    return llama_folder(tmp / "src"), [*FAST[2:], "--kv-lora-rank", "100000"]


def nan_weights(tmp: Path) -> tuple[Path, list[str]]:
    model = tiny_llama(vocab_size=512)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = float("nan")
    model.save_pretrained(tmp / "src")
    return with_tokenizer(tmp / "src"), FAST


# (README row, the setup, the error it must name)
CONVERSION_ROWS = [
    ("a folder that is not a Llama", not_a_llama, "'gpt2' checkpoint; only Llama"),
    ("a sliding window shorter than the context", mistral_with_a_short_window, "sliding-window attention"),
    ("a QK-norm model (Qwen3, Gemma3)", a_qk_norm_model, "'qwen3' checkpoint.*QK-norm"),
    ("missing weights", missing_weights, "Could not read the weights.*model.safetensors"),
    ("corrupt weights", corrupt_weights, "Could not read the weights.*re-download"),
    ("a tokenizer missing", missing_tokenizer, "Could not load a tokenizer.*tokenizer files"),
    ("an empty calibration text", empty_text, "is empty"),
    (
        "a calibration text shorter than one block",
        text_shorter_than_a_block,
        "fewer than one block of 32: give more text",
    ),
    ("--kv-cut outside (0, 1)", kv_cut_outside, r"kv_cut must lie in \(0, 1\)"),
    ("--kv-cut leaving no latent", kv_cut_leaving_no_latent, "cut leaves .* lower rope_pairs or kv_cut"),
    ("a rank larger than the source allows", rank_too_large, r"rank must lie in \[1, 64\]"),
    ("NaN or inf in the source weights", nan_weights, "layers.1.self_attn.k_proj.weight holds NaN or inf"),
]


@pytest.mark.parametrize(("row", "setup", "message"), CONVERSION_ROWS, ids=[row[0] for row in CONVERSION_ROWS])
def test_bad_conversion_input_is_refused_by_name_and_nothing_is_written(tmp_path, row, setup, message):
    source, flags = setup(tmp_path)
    before = digest(source)
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=message):
        main(["convert", str(source), str(out), *flags])
    assert not out.exists() and not [path for path in tmp_path.iterdir() if path.name.startswith(".out")]
    assert digest(source) == before


def test_an_output_inside_the_source_or_existing_is_refused(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(STORIES260K, source)
    before = digest(source)
    with pytest.raises(SystemExit, match="overlaps the input"):
        main(["convert", str(source), str(source / "inside"), *FAST])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("a user's file")
    with pytest.raises(SystemExit, match="exists; pass --overwrite"):
        main(["convert", str(source), str(tmp_path / "out"), *FAST])
    assert (tmp_path / "out" / "keep.txt").read_text() == "a user's file" and digest(source) == before


def test_bad_model_input_is_refused_by_name():
    model = tiny_model(gate_position="kv").eval()
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=128\); got values from 3 to 128"):
        model(torch.tensor([[3, 128]]))
    with pytest.raises(TypeError, match="cache must be a transformers Cache.*got tuple"):
        model(torch.tensor([[3, 4]]), cache=((torch.zeros(1),),))
    from transformers import DynamicCache

    with pytest.raises(ValueError, match="needs a cache that keeps them per token"):
        model(torch.tensor([[3, 4]]), cache=DynamicCache())


def test_a_conversion_that_will_not_fit_in_memory_is_warned_before_it_runs(monkeypatch, tmp_path, capsys):
    from egmla.conversion import memory
    from egmla.training import FinetuneSettings

    teacher = tiny_llama()
    source_bytes = teacher.get_memory_footprint(return_buffers=False)
    monkeypatch.setattr(memory, "get_max_memory", lambda: {"cpu": 2 * source_bytes})
    full = memory.memory_warning(teacher, FinetuneSettings())
    assert full and f"{4 * source_bytes / 1e9:.1f} GB more on cpu" in full and "--dtype bfloat16" in full
    assert memory.memory_warning(teacher, FinetuneSettings(lora=True)) is None  # the student alone fits
    assert memory.memory_warning(teacher, None) is None
    monkeypatch.setattr(memory, "get_max_memory", lambda: {})  # unknown: nothing to say
    assert memory.memory_warning(teacher, FinetuneSettings()) is None

    # The command says so before its long stages, and still converts.
    source = llama_folder(tmp_path / "src")
    monkeypatch.setattr(memory, "get_max_memory", lambda: {"cpu": 1})
    main(["convert", str(source), "--out", str(tmp_path / "out"), *FAST, "--steps", "0", "--eval-documents", "2"])
    output = capsys.readouterr().out
    assert "it may run out of memory" in output and (tmp_path / "out" / "config.json").exists()
