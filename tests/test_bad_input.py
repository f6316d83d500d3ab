"""The README's bad-input table, row by row: each bad input gets an error that names the problem (and what to do),
nothing is written, and the source is left as it was."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from egmla import EGMLAConfig, EGMLAForCausalLM
from egmla.cli import main
from tests.utils import (
    FAST,
    STORIES260K,
    llama_folder,
    tiny_llama,
    tiny_model,
    tiny_source,
    with_tokenizer,
)
from tests.utils import folder_digest as digest


def not_a_llama(tmp: Path) -> tuple[Path, list[str]]:
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=512)).save_pretrained(tmp / "src")
    return with_tokenizer(tmp / "src"), FAST


def mistral_with_a_short_window(tmp: Path) -> tuple[Path, list[str]]:
    tiny_source("mistral", vocab_size=512, sliding_window=32).save_pretrained(tmp / "src")
    return with_tokenizer(tmp / "src"), FAST


def a_gemma3_with_logit_softcapping(tmp: Path) -> tuple[Path, list[str]]:
    tiny_source("gemma3", vocab_size=512, attn_logit_softcapping=50.0).save_pretrained(tmp / "src")
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
    return llama_folder(tmp / "src"), ["--kv-cut", "0.99", "--rope-split", "shared", "--calibration-blocks", "4",
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
    ("a Gemma 3 with what egmla does not carry", a_gemma3_with_logit_softcapping, "attn_logit_softcapping=50.0"),
    ("missing weights", missing_weights, "Could not read the weights.*model.safetensors"),
    ("corrupt weights", corrupt_weights, "Could not read the weights.*re-download"),
    ("a tokenizer missing", missing_tokenizer, "Could not load a tokenizer.*tokenizer files"),
    ("an empty calibration text", empty_text, "is empty"),
    (
        "a calibration text shorter than one block",
        text_shorter_than_a_block,
        "fewer than one block of 32: give more text",
    ),
    ("--kv-cut outside (0, 1)", kv_cut_outside, r"kv_cut \(--kv-cut\) must lie in \(0, 1\)"),
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
        main(["convert", str(source), "--out", str(out), *flags])
    assert not out.exists() and not [path for path in tmp_path.iterdir() if path.name.startswith(".out")]
    assert digest(source) == before


def test_an_output_inside_the_source_or_existing_is_refused(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(STORIES260K, source)
    before = digest(source)
    with pytest.raises(SystemExit, match="overlaps the input"):
        main(["convert", str(source), "--out", str(source / "inside"), *FAST])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("a user's file")
    with pytest.raises(SystemExit, match="exists; pass --overwrite"):
        main(["convert", str(source), "--out", str(tmp_path / "out"), *FAST])
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


@pytest.mark.parametrize("autocast_bf16", [False, True])
def test_the_memory_estimate_counts_what_a_student_layer_saves_for_its_backward(autocast_bf16):
    """Per token, a student decoder layer's saved tensors (counted by storage, two lengths apart so that the per-step
    copies of weights cancel) are what `saved_bytes_per_token` says, within 20%."""
    from egmla.conversion import memory

    shape = dict(vocab_size=64, hidden_size=256, intermediate_size=640, num_attention_heads=4, num_key_value_heads=2,
                 kv_lora_rank=48, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64)  # fmt: skip

    def saved_bytes(layers: int, tokens: int) -> int:
        torch.manual_seed(0)
        model, storages = EGMLAForCausalLM(EGMLAConfig(num_hidden_layers=layers, **shape)), {}

        def keep(tensor):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
                model(input_ids=torch.randint(0, 64, (2, tokens)), use_cache=False)
        return sum(storages.values())

    def layer(tokens: int) -> int:  # the embedding, the final norm and the head save per token too
        return saved_bytes(2, tokens) - saved_bytes(1, tokens)

    per_token = (layer(96) - layer(32)) / (2 * 64)
    config = EGMLAConfig(**shape)
    assert per_token == pytest.approx(memory.saved_bytes_per_token(config, autocast_bf16), rel=0.2)


def test_a_conversion_that_will_not_fit_in_memory_is_refused_before_its_long_stages(monkeypatch, tmp_path, capsys):
    from egmla.conversion import memory

    teacher = tiny_llama()
    source_bytes = teacher.get_memory_footprint(return_buffers=False)
    full = memory.MemoryShape(4, 64, True, False, 32)
    estimate = memory.estimate_memory(teacher, full)
    assert estimate.student == source_bytes and estimate.training == 3 * source_bytes
    # the recovery's logits (two forward copies and two float32 ones) and each layer's saved values, or the scoring
    tokens, config = 4 * 64, teacher.config
    per_token = (6 + 8) * config.hidden_size + 4 * config.intermediate_size  # float32: no autocast
    assert estimate.activations == tokens * config.vocab_size * 16 + 2 * tokens * per_token * 4
    lora = memory.estimate_memory(teacher, memory.MemoryShape(4, 64, False, False, 32))
    assert lora.training == 0 and lora.peak < estimate.peak
    monkeypatch.setattr(memory, "get_max_memory", lambda: {"cpu": 2 * source_bytes})
    with pytest.raises(
        ValueError, match=r"needs about .* GB more on cpu .*--dtype bfloat16.*--lora.*--stream.*--force"
    ):
        memory.check_memory(teacher, full)
    assert memory.check_memory(teacher, full, force=True) == estimate
    monkeypatch.setattr(memory, "get_max_memory", lambda: {})  # unknown: nothing to say
    assert memory.check_memory(teacher, full) == estimate

    # The command refuses before its long stages, and with --force converts, saying so; the report holds the estimate.
    source, out = llama_folder(tmp_path / "src"), tmp_path / "out"
    monkeypatch.setattr(memory, "get_max_memory", lambda: {"cpu": 1})
    command = ["convert", str(source), "--out", str(out), *FAST, "--steps", "0", "--eval-documents", "2"]
    with pytest.raises(SystemExit, match="--force runs it anyway"):
        main(command)
    assert not out.exists()
    main([*command, "--force"])
    assert "warning: this conversion needs about" in capsys.readouterr().out
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["memory"]["predicted_peak_gb"] > 0


# Every option, file and source is checked when the job is built: the CLI prints one line and exits with status 2
# before loading the source's weights, and writes nothing. (README row, the command's arguments after `convert SRC
# --out OUT`, the error.)
def calibration_text(tmp: Path) -> str:
    return str(text_file(tmp, "\n<|endoftext|>\n".join(["Once upon a time a small cat sat in the sun."] * 40)))


def no_source(tmp: Path) -> tuple[Path, list[str]]:
    return tmp / "nowhere", FAST


def empty_source_folder(tmp: Path) -> tuple[Path, list[str]]:
    (tmp / "src").mkdir()
    return tmp / "src", FAST


def missing_train_text(tmp: Path) -> tuple[Path, list[str]]:
    return llama_folder(tmp / "src"), [*FAST, "--train-text", str(tmp / "typo.txt")]


def empty_eval_text(tmp: Path) -> tuple[Path, list[str]]:
    (tmp / "eval.txt").write_text("\n")
    return llama_folder(tmp / "src"), [*FAST, "--eval-text", str(tmp / "eval.txt")]


def flags(*given: str):
    """The flags with a calibration text: the recovery runs, so its flags mean something."""
    return lambda tmp: (llama_folder(tmp / "src"), [*FAST, "--train-text", calibration_text(tmp), *given])


def without_text(*given: str):
    return lambda tmp: (llama_folder(tmp / "src"), [*FAST, *given])


def streamed_with(*given: str):
    return lambda tmp: (llama_folder(tmp / "src"), [*FAST, "--stream", "--train-text", calibration_text(tmp), *given])


def tokenizer_past_the_vocabulary(tmp: Path) -> tuple[Path, list[str]]:
    return llama_folder(tmp / "src", vocab_size=256), FAST


REFUSED_BEFORE_WORK = [
    ("a source path that does not exist", no_source, "nowhere is not a local folder or file, nor a Hub model"),
    ("an empty folder as source", empty_source_folder, "src has no config.json"),
    ("--train-text that does not exist", missing_train_text, r"train_text \(--train-text\): .*typo.txt is not a file"),
    ("--eval-text empty", empty_eval_text, r"eval_text \(--eval-text\): .*eval.txt is empty"),
    ("--block-size 0", flags("--block-size", "0"), r"block_size \(--block-size\) must be >= 2, got 0"),
    ("--eval-blocks 0", flags("--eval-blocks", "0"), r"eval_blocks \(--eval-blocks\) must be >= 1, got 0"),
    ("--calibration-blocks 0", flags("--calibration-blocks", "0"), r"\(--calibration-blocks\) must be >= 1, got 0"),
    ("--learning-rate -1", flags("--learning-rate", "-1"), r"learning_rate \(--learning-rate\) must be > 0, got -1"),
    ("--max-minutes nan", flags("--max-minutes", "nan"), r"\(--max-minutes\) must be a number and be > 0, got nan"),
    ("--batch-size 0", flags("--batch-size", "0"), r"batch_size \(--batch-size\) must be >= 1, got 0"),
    ("--eval-documents 0", flags("--eval-documents", "0"), r"\(--eval-documents\) must be >= 1, got 0"),
    (
        "--reconstruction-learning-rate 0",
        flags("--reconstruction-learning-rate", "0"),
        r"\(--reconstruction-learning-rate\) must be > 0",
    ),
    ("--time-limit 0", flags("--time-limit", "0"), r"time_limit \(--time-limit\) must be > 0, got 0"),
    ("--steps -1", flags("--steps", "-1"), r"steps \(--steps\) must be positive, got -1"),
    ("--gate-position kv without a gate", flags("--gate-position", "kv"), "places a gate, and there is none"),
    ("--stream with --steps", streamed_with("--steps", "5"), "--steps would do nothing: --stream fits layer by layer"),
    ("--stream with --max-minutes", streamed_with("--max-minutes", "2"), "--max-minutes would do nothing: --stream"),
    ("--stream with --score-stages", streamed_with("--score-stages"), "--score-stages would do nothing: --stream"),
    ("--stream with --time-limit", streamed_with("--time-limit", "5"), "--time-limit would do nothing: --stream"),
    ("--stream with --lora", streamed_with("--lora"), "--lora would do nothing: --stream"),
    (
        "recovery flags without --train-text",
        without_text("--learning-rate", "1e-4", "--lora"),
        "--learning-rate, --lora would do nothing: convert recovers the model only on text",
    ),
    ("recovery flags with --steps 0", flags("--steps", "0", "--batch-size", "2"), "--batch-size would do nothing"),
    ("--resume with no killed run", flags("--resume"), "there is no killed run of .*out to resume"),
    (
        "--source-sample-share without --train-text",
        without_text("--source-sample-share", "0.2"),
        "--source-sample-share would do nothing: they mix samples into --train-text",
    ),
    (
        "--time-limit with --steps 0",
        flags("--steps", "0", "--time-limit", "5"),
        "--time-limit would do nothing: --steps 0",
    ),
    (
        "--calibration-blocks 1 with the split search",
        lambda tmp: (llama_folder(tmp / "src"), ["--kv-lora-rank", "16", "--calibration-blocks", "1"]),
        "the split search .* holds out a calibration block",
    ),
    ("--sample-temperatures with none", flags("--sample-temperatures"), "needs at least one temperature"),
    (
        "a tokenizer larger than the model's vocabulary",
        tokenizer_past_the_vocabulary,
        "has 512 tokens, more than the model's vocab_size 256",
    ),
]


@pytest.mark.parametrize(("row", "setup", "message"), REFUSED_BEFORE_WORK, ids=[row[0] for row in REFUSED_BEFORE_WORK])
def test_bad_input_is_refused_in_one_line_with_status_2_before_the_weights_load(
    tmp_path, monkeypatch, capsys, row, setup, message
):
    from egmla.conversion import pipeline, streaming

    def no_work(*args, **kwargs):
        raise AssertionError("the source's weights were loaded before the input was checked")

    monkeypatch.setattr(pipeline, "load_llama", no_work)
    monkeypatch.setattr(streaming, "ShardedLayers", no_work)
    source, given = setup(tmp_path)
    before = digest(source) if source.exists() else None
    out = tmp_path / "out"
    capsys.readouterr()  # what writing the source printed
    with pytest.raises(SystemExit, match=message) as refused:
        main(["convert", str(source), "--out", str(out), *given])
    assert refused.value.code == 2
    printed = capsys.readouterr().err.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith("egmla convert: ") and "Traceback" not in printed[0]
    assert not out.exists() and not [path for path in tmp_path.iterdir() if path.name.startswith(".out")]
    assert (digest(source) if source.exists() else None) == before


@pytest.fixture(scope="module")
def converted_student(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama folder and its conversion (closed form, no recovery)."""
    folder = tmp_path_factory.mktemp("finetune")
    source = llama_folder(folder / "src")
    main(["convert", str(source), "--out", str(folder / "student"), *FAST, "--steps", "0", "--eval-documents", "2"])
    return source, folder / "student"


def test_finetune_refuses_a_resume_without_checkpoints_and_a_teacher_that_is_not_the_source(
    tmp_path, converted_student
):
    source, student = converted_student
    text = calibration_text(tmp_path)
    command = ["finetune", str(student), "--teacher", str(source), "--train-text", text, "--steps", "2"]
    with pytest.raises(SystemExit, match=r"--resume: .*typo holds no checkpoint to resume from") as refused:
        main([*command, "--out", str(tmp_path / "out"), "--resume", "--checkpoint-dir", str(tmp_path / "typo")])
    assert refused.value.code == 2
    other = llama_folder(tmp_path / "other", hidden_size=32, head_dim=8)
    with pytest.raises(SystemExit, match="is not the student's source: its hidden_size is 32, the student's 64"):
        main(["finetune", str(student), "--teacher", str(other), "--train-text", text, "--out", str(tmp_path / "o")])
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()


def test_finetune_and_ppl_refuse_nan_weights_by_name(tmp_path, converted_student):
    source, student = converted_student
    damaged = tmp_path / "damaged"
    model = tiny_llama(vocab_size=512)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    model.save_pretrained(damaged)
    with_tokenizer(damaged)
    text = calibration_text(tmp_path)
    with pytest.raises(SystemExit, match="The model's weight model.layers.0.mlp.up_proj.weight holds NaN or inf"):
        main(["ppl", str(damaged), "--eval-text", text])
    with pytest.raises(SystemExit, match="The source's weight model.layers.0.mlp.up_proj.weight holds NaN or inf"):
        main(["finetune", str(student), "--teacher", str(damaged), "--train-text", text, "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match=r"block_size \(--block-size\) must be >= 2, got 1"):
        main(["ppl", str(source), "--eval-text", text, "--block-size", "1"])


@pytest.mark.parametrize("raised_by", ["os", "safetensors"])
def test_a_full_disk_while_saving_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys, raised_by):
    import errno
    import types

    from safetensors import SafetensorError

    import egmla.cli as cli
    from egmla.modeling_egmla import EGMLAForCausalLM

    def full_disk(self, folder, *args, **kwargs):
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        if raised_by == "os":
            raise OSError(errno.ENOSPC, "No space left on device")
        # safetensors (and torch.save) say it with their own error types; the disk is then (nearly) full
        monkeypatch.setattr(cli.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=0))
        raise SafetensorError("Error while serializing: I/O error")

    monkeypatch.setattr(EGMLAForCausalLM, "save_pretrained", full_disk)
    source, out = llama_folder(tmp_path / "src"), tmp_path / "out"
    with pytest.raises(SystemExit, match="No space left on device|disk holding .*out is full") as refused:
        main(["convert", str(source), "--out", str(out), *FAST, "--steps", "0", "--eval-documents", "2"])
    assert refused.value.code == 2 and "Traceback" not in capsys.readouterr().err
    assert not out.exists() and not [path for path in tmp_path.iterdir() if path.name.startswith(".out")]


def test_an_unreadable_source_card_is_said_unless_the_licence_is_given(tmp_path, monkeypatch):
    from egmla import hub

    folder = llama_folder(tmp_path / "src")
    (folder / "README.md").write_text("---\nlicense: [unclosed\n---\n# a card\n")
    with pytest.warns(UserWarning, match="Could not read the model card of .*README.md.*give --license ID"):
        assert hub.source_metadata(folder).license is None
    assert hub.source_metadata(folder, license="mit").license == "mit"

    def offline(repo_id):
        raise OSError("offline")

    monkeypatch.setattr(hub.ModelCard, "load", offline)
    with pytest.warns(UserWarning, match="Could not read the model card of someone/model .offline."):
        assert hub.source_metadata("someone/model").base_model == "someone/model"


def test_float16_converts_in_closed_form_and_refuses_to_train_without_loss_scaling(tmp_path):
    from transformers import AutoModelForCausalLM

    source, text = llama_folder(tmp_path / "src"), calibration_text(tmp_path)
    with pytest.raises(SystemExit, match="--dtype float16 would train .* without loss scaling"):
        main(["convert", str(source), "--out", str(tmp_path / "o"), *FAST, "--dtype", "float16", "--train-text", text])
    closed_form = [*FAST, "--steps", "0", "--eval-documents", "2"]
    for dtype in ("float16", "float32"):
        main(["convert", str(source), "--out", str(tmp_path / dtype), *closed_form, "--dtype", dtype])
    half, full = (AutoModelForCausalLM.from_pretrained(tmp_path / dtype) for dtype in ("float16", "float32"))
    assert half.dtype == torch.float16 and full.dtype == torch.float32
    ids = torch.randint(3, 500, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(half.float()(ids).logits, full(ids).logits, atol=2e-2, rtol=2e-2)


def test_a_score_that_is_not_a_number_is_null_and_reports_are_strict_json():
    import json

    from egmla.outputs import report_json

    def refuse(constant: str):
        raise AssertionError(f"{constant} in a report")

    report = {"perplexity": {"source": 10.0, "fine-tuned": float("nan")}, "history": [1.5, float("inf")], "steps": 3}
    parsed = json.loads(report_json(report), parse_constant=refuse)
    assert parsed == {"perplexity": {"source": 10.0, "fine-tuned": None}, "history": [1.5, None], "steps": 3}


def test_resume_refuses_the_work_of_another_job(tmp_path):
    source, out = llama_folder(tmp_path / "src"), tmp_path / "out"
    (tmp_path / ".out.resume").mkdir()
    (tmp_path / ".out.resume" / "job.json").write_text('{"source": "another"}')
    command = ["convert", str(source), "--out", str(out), *FAST, "--train-text", calibration_text(tmp_path)]
    with pytest.raises(SystemExit, match=r"--resume: the killed run in .*\.out\.resume was another job \(its .*source"):
        main([*command, "--resume"])
    assert not out.exists() and (tmp_path / ".out.resume" / "job.json").exists()  # its work is left as it was


def test_a_card_leaves_out_scores_that_are_not_numbers(tmp_path, converted_student):
    import json

    from huggingface_hub import ModelCard

    from egmla.conversion.report import ConversionReport, write_model_card

    _, student = converted_student
    report = json.loads((student / "conversion_report.json").read_text())
    report["perplexity"][report["saved_stage"]] = float("nan")  # a diverged stage
    for row in report["stages"]:
        row["selection_loss"] = float("inf")
    write_model_card(tmp_path, ConversionReport.from_dict(report))
    card = ModelCard.load(tmp_path / "README.md")
    assert not card.data.eval_results and "nan" not in card.text.lower()
    strict = json.loads((tmp_path / "conversion_report.json").read_text(), parse_constant=lambda name: 1 / 0)
    assert strict["perplexity"][report["saved_stage"]] is None


def test_bench_counts_below_one_are_refused_before_any_run():
    for flags, message in ((["decode", "--repetitions", "0"], "--repetitions must be >= 1, got 0"),
                           (["decode", "--contexts", "512", "0"], "--contexts must be >= 1, got 0"),
                           (["train", "--steps", "-1"], "--steps must be >= 1, got -1"),
                           (["decode", "--budget-mib", "0"], "--budget-mib must be > 0")):  # fmt: skip
        with pytest.raises(SystemExit, match=message):
            main(["bench", *flags])
