"""Recovery fine-tuning: distillation lowers the loss, LoRA merges, an interrupted run resumes identically."""

import copy
import dataclasses
import json
import math

import pytest
import torch

import egmla.precision as precision
import egmla.training as finetune_module
from egmla.cli import main
from egmla.conversion import ConversionOptions, convert_llama_to_egmla
from egmla.modeling_egmla import EGMLAForCausalLM
from egmla.text import token_blocks
from egmla.training import FinetuneSettings, distillation_loss, finetune, forward_logits
from tests.utils import STORIES260K, TINYSTORIES, needs_shared, tiny_llama, tiny_model, tiny_source


@pytest.fixture()
def pair():
    teacher = tiny_llama()
    blocks = torch.randint(3, 96, (16, 32), generator=torch.Generator().manual_seed(0))
    student = convert_llama_to_egmla(
        teacher, ConversionOptions(kv_lora_rank=12, rope_pairs=2, gate_embedding_dim=8), blocks[:4]
    )
    return teacher, student, blocks


def test_distillation_loss_is_zero_only_for_equal_logits():
    logits = torch.randn(2, 5, 11)
    assert distillation_loss(logits, logits, 2.0).abs() < 1e-6
    assert distillation_loss(logits, logits + torch.randn_like(logits), 2.0) > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_distillation_loss_and_its_gradient_equal_torchs_kl_div(temperature, monkeypatch):
    """The chunked loss (here in chunks of 32 rows of 101 logits, 2 x 37 = 74 rows: a partial last chunk) against the
    textbook formula with torch's kl_div, value and gradient."""
    monkeypatch.setattr("egmla.training.DISTILLATION_ELEMENTS_PER_CHUNK", 32 * 101 + 50)
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(2, 37, 101, generator=generator, requires_grad=True)
    teacher = torch.randn(2, 37, 101, generator=generator)
    reference_student = student.detach().clone().requires_grad_()
    log_student = torch.log_softmax(reference_student / temperature, dim=-1)
    log_teacher = torch.log_softmax(teacher / temperature, dim=-1)
    reference = torch.nn.functional.kl_div(log_student, log_teacher, log_target=True, reduction="none")
    reference = reference.sum(-1).mean() * temperature**2
    (3.0 * reference).backward()
    loss = distillation_loss(student, teacher, temperature)
    (3.0 * loss).backward()
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(student.grad, reference_student.grad)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_five_steps_lower_the_distillation_loss(pair, lora):
    teacher, student, blocks = pair
    settings = FinetuneSettings(
        steps=5, batch_size=8, learning_rate=3e-3, warmup_steps=1, lora=lora, eval_every=0, ce_weight=0.5
    )

    def objective(model):  # what the settings train: KL to the teacher + 0.5 * next-token cross-entropy
        with torch.no_grad():
            out = model(blocks, labels=blocks)
            return distillation_loss(out.logits, teacher(blocks).logits, 1.0) + 0.5 * out.loss

    before = objective(student)
    tables_before = student.model.gate_embeddings[0].weight.detach().clone()
    result = finetune(student, teacher, blocks, settings)
    assert isinstance(result.model, EGMLAForCausalLM)  # LoRA merged back into a plain model
    assert objective(result.model) < before
    # The gate learned: its zero-initialised up-projection moved, and so did the tables.
    assert result.model.model.layers[0].self_attn.gate_embedding_proj.weight.abs().max() > 0
    assert not torch.equal(result.model.model.gate_embeddings[0].weight, tables_before)
    assert [entry["step"] for entry in result.history] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("family", ["egmla", "gemma3"])
def test_logits_over_a_vocabulary_are_those_columns_of_the_whole_heads(family):
    """The distillation's logits over some token ids, from the last hidden states, equal those columns of the model's
    own logits (Gemma's soft-capping included)."""
    model = tiny_model() if family == "egmla" else tiny_source("gemma3", final_logit_softcapping=2.0)
    batch = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    vocabulary = torch.tensor([0, 5, 17, 40, 95])
    with torch.no_grad():
        logits, loss = forward_logits(model, model, batch, vocabulary)
        torch.testing.assert_close(logits, model(batch).logits[..., vocabulary])
    assert loss is None


def test_a_head_larger_than_the_layers_is_distilled_over_the_texts_tokens():
    """Where the head has more weights than the layers and is not trained, `auto` distills over the training text's
    tokens; the KL over the whole vocabulary falls all the same."""
    teacher = tiny_llama(vocab_size=4096)
    blocks = torch.randint(3, 300, (16, 32), generator=torch.Generator().manual_seed(0))
    student = convert_llama_to_egmla(teacher, ConversionOptions(kv_lora_rank=4, rope_pairs=1), blocks[:4])

    def whole_vocabulary_kl(model):
        with torch.no_grad():
            return distillation_loss(model(blocks).logits, teacher(blocks).logits, 1.0)

    before = whole_vocabulary_kl(student)
    settings = FinetuneSettings(steps=10, batch_size=8, learning_rate=1e-3, warmup_steps=1, eval_every=0,
                                attention_only=True)  # fmt: skip
    result = finetune(student, teacher, blocks, settings)
    assert result.distilled_tokens == len(torch.unique(blocks))
    assert whole_vocabulary_kl(result.model) < before
    lora = dataclasses.replace(settings, attention_only=False, lora=True, learning_rate=3e-3)
    with_adapters = finetune(copy.deepcopy(student), teacher, blocks, lora)  # the head read through PEFT's model
    assert with_adapters.distilled_tokens == len(torch.unique(blocks))
    assert whole_vocabulary_kl(with_adapters.model) < before
    # All weights trained (what an attention-only run left frozen included): the whole vocabulary.
    whole = dataclasses.replace(settings, attention_only=False)
    trained = finetune(copy.deepcopy(result.model), teacher, blocks, whole)
    for name in ("model.layers.0.mlp.up_proj.weight", "lm_head.weight"):
        assert not torch.equal(trained.model.get_parameter(name), result.model.get_parameter(name)), name
    changes = ({"attention_only": False}, {"ce_weight": 0.5}, {"distillation_vocabulary": "full"})
    for changed in changes:
        changed_settings = dataclasses.replace(settings, steps=1, **changed)
        again = finetune(copy.deepcopy(result.model), teacher, blocks, changed_settings)
        assert again.distilled_tokens is None  # the head trained, a next-token loss, or the whole vocabulary asked


def test_a_small_head_is_distilled_over_the_whole_vocabulary(pair):
    teacher, student, blocks = pair
    settings = FinetuneSettings(steps=1, batch_size=4, eval_every=0, attention_only=True)  # a frozen head
    assert finetune(student, teacher, blocks, settings).distilled_tokens is None
    with pytest.raises(ValueError, match="distillation_vocabulary='text'.*ce_weight"):
        FinetuneSettings(distillation_vocabulary="text", ce_weight=0.5)
    with pytest.raises(ValueError, match="distillation_vocabulary must be one of"):
        FinetuneSettings(distillation_vocabulary="some")


def test_bf16_autocast_trains_and_hands_back_a_model_that_runs_in_fp32(pair, monkeypatch):
    """Under bf16 autocast the loss falls as in fp32, and the model handed back carries no autocast wrapper: its
    logits are those of a plain fp32 model with its weights. "auto" takes bf16 only where the device computes it."""
    teacher, student, blocks = pair
    settings = FinetuneSettings(steps=5, batch_size=8, learning_rate=3e-3, warmup_steps=1, eval_every=0, ce_weight=0.5)

    def objective(model):  # what the settings train: KL to the teacher + 0.5 * next-token cross-entropy
        with torch.no_grad():
            out = model(blocks, labels=blocks)
            return distillation_loss(out.logits, teacher(blocks).logits, 1.0) + 0.5 * out.loss

    before = objective(student)
    result = finetune(student, teacher, blocks, dataclasses.replace(settings, mixed_precision="bf16"))
    assert objective(result.model) < before
    plain = EGMLAForCausalLM(result.model.config).eval()
    plain.load_state_dict(result.model.state_dict())
    with torch.no_grad():
        assert torch.equal(result.model(blocks).logits, plain(blocks).logits)
    assert all(parameter.dtype == torch.float32 for parameter in result.model.parameters())

    cpu, wide, narrow = torch.device("cpu"), precision.BF16_MIN_HIDDEN_SIZE, 64
    monkeypatch.setattr(precision, "native_bf16", lambda device: False)
    assert not precision.uses_bf16("auto", cpu, wide) and precision.uses_bf16("bf16", cpu, narrow)
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    assert precision.uses_bf16("auto", cpu, wide) and not precision.uses_bf16("auto", cpu, narrow)
    assert not precision.uses_bf16("no", cpu, wide)
    with pytest.raises(ValueError, match=r"mixed_precision \(--[a-z-]+\) must be one of"):
        FinetuneSettings(mixed_precision="fp16")


def test_an_interrupted_run_resumes_where_it_stopped(tmp_path, monkeypatch):
    settings = dict(steps=6, batch_size=4, learning_rate=3e-3, warmup_steps=2, eval_every=0, save_every=2)

    teacher = tiny_llama()
    blocks = torch.randint(3, 96, (16, 32), generator=torch.Generator().manual_seed(0))

    def fresh_student():
        return convert_llama_to_egmla(
            teacher, ConversionOptions(kv_lora_rank=12, rope_pairs=2, gate_embedding_dim=8), blocks[:4]
        )

    straight = finetune(fresh_student(), teacher, blocks, FinetuneSettings(**settings))

    calls = {"count": 0}
    real_loss = finetune_module.distillation_loss

    def interrupted(*args, **kwargs):
        calls["count"] += 1
        if calls["count"] == 5:  # dies during step 5, after the checkpoint of step 4
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(finetune_module, "distillation_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        finetune(fresh_student(), teacher, blocks, FinetuneSettings(**settings, checkpoint_dir=tmp_path))
    monkeypatch.undo()
    assert json.loads((tmp_path / "last" / "progress.json").read_text())["step"] == 4

    resumed = finetune(
        fresh_student(), teacher, blocks, FinetuneSettings(**settings, checkpoint_dir=tmp_path, resume=True)
    )
    assert resumed.steps_done == 6
    straight_losses = [entry["loss"] for entry in straight.history]
    resumed_losses = [entry["loss"] for entry in resumed.history]
    assert resumed_losses == pytest.approx(straight_losses, rel=1e-4, abs=1e-6)
    for name, param in straight.model.state_dict().items():
        assert torch.allclose(param, resumed.model.state_dict()[name], atol=1e-5), name


def test_retrofit_end_to_end_on_stories260k(tmp_path):
    """Convert at a 50% cut, fine-tune 5 steps, report and save: the fine-tune lowers the held-out loss."""
    needs_shared(STORIES260K)
    needs_shared(TINYSTORIES)
    out = tmp_path / "out"
    main(
        [
            "retrofit",
            str(STORIES260K),
            "--out",
            str(out),
            "--kv-cut",
            "0.5",
            "--rope-pairs",
            "3",
            "--gate-embedding-dim",
            "16",
            "--train-text",
            str(TINYSTORIES),
            "--steps",
            "5",
            "--learning-rate",
            "3e-3",
            "--batch-size",
            "8",
            "--block-size",
            "128",
            "--calibration-blocks",
            "16",
            "--eval-blocks",
            "16",
            "--eval-documents",
            "16",
            "--eval-every",
            "0",
            "--score-stages",
            "--reconstruction-steps",
            "20",
            "--sampled-blocks",
            "16",
            "--held-aside-samples",
            "6",
        ]
    )
    report = json.loads((out / "conversion_report.json").read_text())
    assert list(report["perplexity"]) == ["source", "zero-shot", "layer-wise", "fine-tuned"]
    assert report["kv"] == {
        "source": 64.0,
        "converted": 32.0,
        "converted_token_id_bytes": 0.0,  # the gate on the latent: no ids to cache
        "converted_position_bytes": 0.0,
    }
    assert report["perplexity"]["fine-tuned"] < report["perplexity"]["zero-shot"]
    assert [row["stage"] for row in report["stages"]] == ["zero-shot", "layer-wise", "fine-tuned"]
    assert report["finetune"]["steps_done"] == 5 and report["sample"].startswith("Once upon a time")
    # Beyond the fitting text: the embedded Wikipedia excerpt and the source's samples held aside, for every model.
    for model in report["perplexity"]:
        assert math.isfinite(report["extra_perplexity"][model]["wikipedia_held_out.txt"])
        agreement = report["source_samples"][model]
        assert math.isfinite(agreement["perplexity"]) and agreement["kl_to_source"] >= 0
    assert report["source_samples"]["source"]["kl_to_source"] == 0
    assert report["source_samples"]["fine-tuned"]["kl_to_source"] > 0
    assert len(report["samples"]) >= 2 and report["held_aside_samples"] > 0
    assert all(0 <= row[name]["repeated_4grams"] <= 1 for row in report["samples"] for name in ("source", "converted"))


def test_finetune_takes_documents_with_their_tokenizer():
    needs_shared(STORIES260K)
    from egmla.conversion import load_llama, load_tokenizer

    teacher, tokenizer = load_llama(STORIES260K), load_tokenizer(STORIES260K)
    documents = ["Once upon a time there was a cat.", "The dog ran to the park and played."] * 20
    student = convert_llama_to_egmla(
        teacher,
        ConversionOptions(kv_cut=0.5, rope_pairs=3, gate_embedding_dim=0),
        token_blocks(tokenizer, documents, 256),
    )
    result = finetune(
        student,
        teacher,
        documents,
        FinetuneSettings(steps=2, batch_size=2, eval_every=0),
        tokenizer=tokenizer,
        block_size=32,
    )
    assert result.steps_done == 2
    with pytest.raises(ValueError, match="tokenizer"):
        finetune(student, teacher, documents, FinetuneSettings(steps=1))


def test_resume_falls_back_to_the_previous_checkpoint(tmp_path):
    """A run that died between the two renames of a checkpoint swap resumes from `last.previous`."""
    teacher = tiny_llama()
    blocks = torch.randint(3, 96, (16, 32), generator=torch.Generator().manual_seed(0))
    student = convert_llama_to_egmla(
        teacher, ConversionOptions(kv_lora_rank=12, rope_pairs=2, gate_embedding_dim=0), blocks[:4]
    )
    settings = dict(steps=4, batch_size=4, eval_every=0, save_every=2, checkpoint_dir=tmp_path)
    finetune(student, teacher, blocks, FinetuneSettings(**settings))
    (tmp_path / "last").rename(tmp_path / "last.previous")
    resumed = finetune(student, teacher, blocks, FinetuneSettings(**settings, resume=True))
    assert resumed.steps_done == 4 and len(resumed.history) == 4
    with pytest.raises(ValueError, match=r"steps \(--steps\) must be positive"):
        finetune(student, teacher, blocks, FinetuneSettings(steps=0))


def test_a_resume_over_another_distilled_vocabulary_is_refused_by_name(tmp_path):
    """A checkpoint records the token ids its loss was distilled over; a resume whose settings or text give other
    ids is refused before it trains (its loss would change mid-schedule), the same ids resume."""
    teacher = tiny_llama()
    blocks = torch.randint(3, 96, (16, 32), generator=torch.Generator().manual_seed(0))
    student = convert_llama_to_egmla(teacher, ConversionOptions(kv_lora_rank=12, rope_pairs=2), blocks[:4])
    settings = FinetuneSettings(steps=4, batch_size=4, eval_every=0, save_every=2, checkpoint_dir=tmp_path,
                                distillation_vocabulary="text", attention_only=True)  # fmt: skip
    finetune(copy.deepcopy(student), teacher, blocks[:8], dataclasses.replace(settings, steps=2))
    record = json.loads((tmp_path / "last" / "progress.json").read_text())["vocabulary"]
    assert record["tokens"] == len(torch.unique(blocks[:8])) and len(record["sha256"]) == 64
    resumed = dataclasses.replace(settings, resume=True)
    whole_vocabulary = dataclasses.replace(resumed, distillation_vocabulary="full")
    with pytest.raises(ValueError, match=r"distilled over \d+ token ids of its text, this run over the whole vocab"):
        finetune(copy.deepcopy(student), teacher, blocks[:8], whole_vocabulary)
    with pytest.raises(ValueError, match=r"--resume: the checkpoint in .* distilled over \d+ token ids of its text, "
                                         r"this run over \d+ token ids of its text"):  # fmt: skip
        finetune(copy.deepcopy(student), teacher, blocks[8:] % 50, resumed)  # other text, fewer ids
    assert finetune(copy.deepcopy(student), teacher, blocks[:8], resumed).steps_done == 4


def test_a_run_stopped_at_its_time_limit_resumes_to_the_same_model(tmp_path):
    """A kill after the last checkpoint of a run that stopped early (its minutes spent) trains no further on
    resume: the checkpoint says the run ended."""
    teacher = tiny_llama()
    blocks = torch.randint(3, 96, (16, 32), generator=torch.Generator().manual_seed(0))
    student = convert_llama_to_egmla(
        teacher, ConversionOptions(kv_lora_rank=12, rope_pairs=2, gate_embedding_dim=0), blocks[:4]
    )
    settings = dict(steps=50, batch_size=4, eval_every=0, save_every=0, checkpoint_dir=tmp_path, max_minutes=1e-6)
    stopped = finetune(copy.deepcopy(student), teacher, blocks, FinetuneSettings(**settings))
    assert stopped.stopped_early and stopped.steps_done < 50
    resumed = finetune(copy.deepcopy(student), teacher, blocks, FinetuneSettings(**settings, resume=True))
    assert resumed.steps_done == stopped.steps_done and resumed.history == stopped.history
    resumed_state = resumed.model.state_dict()
    for name, tensor in stopped.model.state_dict().items():
        assert torch.equal(tensor, resumed_state[name]), name


def test_finetune_cli_refuses_an_existing_output_and_resumes(tmp_path, capsys):
    needs_shared(STORIES260K)
    needs_shared(TINYSTORIES)
    converted = tmp_path / "converted"
    main(
        [
            "convert",
            str(STORIES260K),
            "--out",
            str(converted),
            "--kv-cut",
            "0.5",
            "--rope-pairs",
            "3",
            "--train-text",
            str(TINYSTORIES),
            "--steps",
            "0",
            "--reconstruction-steps",
            "0",
            "--source-sample-share",
            "0",
            "--held-aside-samples",
            "0",
            "--block-size",
            "64",
            "--calibration-blocks",
            "8",
            "--eval-documents",
            "8",
        ]
    )
    out = tmp_path / "tuned"
    args = [
        "finetune",
        str(converted),
        "--teacher",
        str(STORIES260K),
        "--out",
        str(out),
        "--train-text",
        str(TINYSTORIES),
        "--block-size",
        "64",
        "--eval-blocks",
        "4",
        "--eval-documents",
        "8",
        "--batch-size",
        "4",
        "--eval-every",
        "0",
        "--save-every",
        "2",
    ]
    main([*args, "--steps", "2"])
    assert json.loads((out / "finetune_report.json").read_text())["steps_done"] == 2
    with pytest.raises(SystemExit, match="exists"):
        main([*args, "--steps", "4", "--resume"])
    capsys.readouterr()
    main([*args, "--steps", "4", "--resume", "--overwrite"])  # continues from the checkpoint of step 2
    assert "at step 2" in capsys.readouterr().out
    report = json.loads((out / "finetune_report.json").read_text())
    assert report["steps_done"] == 4
    with pytest.raises(SystemExit, match="overlaps the input"):
        main([*args, "--steps", "2", "--out", str(converted), "--overwrite"])


def test_a_run_without_steps_takes_what_fits_in_its_minutes(pair):
    teacher, student, blocks = pair
    settings = FinetuneSettings(steps=None, max_minutes=0.02, batch_size=4, eval_every=0)
    result = finetune(student, teacher, blocks, settings)
    assert result.steps_planned >= 2 and 2 <= result.steps_done <= result.steps_planned
    assert result.seconds < 0.02 * 60 + 5  # the schedule was sized to the budget, and the guard stops it
    # The two steps timed to size the schedule are the run's first two, in its history, not passes thrown away.
    assert [entry["step"] for entry in result.history if "loss" in entry] == list(range(1, result.steps_done + 1))
    with pytest.raises(ValueError, match="steps=None sizes the run to max_minutes"):
        FinetuneSettings(steps=None, max_minutes=None)


def test_a_checkpoint_without_its_schedule_length_is_not_budgeted_again(pair, tmp_path):
    teacher, student, blocks = pair
    settings = dict(batch_size=4, eval_every=0, save_every=2, checkpoint_dir=tmp_path)
    finetune(student, teacher, blocks, FinetuneSettings(steps=2, **settings))
    progress = tmp_path / "last" / finetune_module.PROGRESS_FILE
    saved = json.loads(progress.read_text())
    del saved["steps"], saved["finished"]  # as an older checkpoint wrote it
    progress.write_text(json.dumps(saved))
    budgeted = FinetuneSettings(steps=None, max_minutes=0.05, resume=True, **settings)
    with pytest.raises(ValueError, match=r"does not say how long its schedule was: resume it with --steps N"):
        finetune(student, teacher, blocks, budgeted)


def test_the_steps_after_the_timed_two_follow_the_budgeted_schedule(pair):
    teacher, student, blocks = pair
    settings = FinetuneSettings(steps=None, max_minutes=0.05, batch_size=4, eval_every=0, warmup_steps=2)
    run, history = finetune_module.prepare_run(student, settings), []
    steps = finetune_module.budgeted_start(run, teacher, blocks, settings, history)
    assert [entry["step"] for entry in history] == [1, 2] and run.schedule.steps == steps >= 2
    # The third step's rate is the schedule's at its real length, not at the provisional one of the first two.
    expected = settings.learning_rate * finetune_module.CosineSchedule(2, steps)(2)
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(expected)
