"""The jobs behind `egmla retrofit` (the main job), `egmla convert`, `egmla finetune` and `egmla ppl`."""

import dataclasses
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM

from ..hub import public_name, source_metadata
from ..measure import kv_values_per_token
from ..modeling_egmla import EGMLAForCausalLM
from ..options import Placement, check_bounds, check_fields, check_text_file, option
from ..outputs import atomic_folder, check_output_folder, report_json
from ..precision import uses_bf16
from ..sampling import OPENINGS, repeated_ngram_share, source_prompts
from ..text import (
    perplexity,
    read_documents,
    token_blocks,
)
from ..training import FinetuneSettings, finetune, resume_checkpoint, saved_checkpoint, settings_summary
from . import families
from .convert import ConversionOptions, assemble, student_config
from .decode_cost import cost_row, egmla_cost, measure_decode, rebuild_warning, source_cost
from .fitting_text import TextData, TextSettings, held_out_dataset, prepare_text, recovery_settings
from .layer_pass import HeldLayers, LayerPass, PassText, check_options, run_pass
from .layer_source import ModelLayers
from .memory import GB, MemoryShape, check_memory
from .reconstruction import ReconstructionSettings
from .report import ConversionReport, job_card, print_report, write_finetune_card, write_model_card
from .scoring import StageSelection, add_scores, score_documents
from .source import (
    check_finite,
    check_tokenizer,
    load_llama,
    load_tokenizer,
    read_config,
    source_config,
    split_gguf,
)
from .timing import StageTimes
from .work import WorkFolder, check_resumable, start_work, work_folder


@dataclass
class ConversionJob:
    """One `egmla convert` or `egmla retrofit`: what to convert, how, on which text, and whether to fine-tune."""

    source: str
    out: Path
    options: ConversionOptions
    text: TextSettings
    reconstruction: ReconstructionSettings = ReconstructionSettings()
    finetune: FinetuneSettings | None = None  # None: convert only
    overwrite: bool = option(False, "replace OUT if it exists")
    sample_prompt: str | None = option(
        None, "a prompt whose greedy continuations by the source and the converted model the report shows"
    )
    score_stages: bool = option(
        False,
        "score every fitting stage (zero-shot, layer-wise, fine-tuned) on the held-out documents, not only the source "
        "and the saved model (each score is a pass over the documents)",
    )
    base_model: str | None = option(
        None, "the card's base_model, a Hub id (default: the source's, from its name, config or GGUF metadata)"
    )
    license: str | None = option(
        None, "the card's licence, a Hub licence id such as apache-2.0 (default: the source's card, config or GGUF)"
    )
    time_limit: float | None = option(
        None,
        "minutes for the whole job: the recovery is cut to what the other stages and the final scoring leave of it",
        bounds="(0, inf)",
    )
    placement: Placement = Placement()  # the source's and the student's device and dtype (the output's dtype)
    resume: bool = option(
        False,
        "continue a killed run of the same job from its last fitted layer or recovery checkpoint (kept in "
        ".OUT.resume beside OUT until the output is saved)",
    )
    force: bool = option(False, "run even where the memory estimate says the conversion will not fit")
    stream: bool = option(
        False,
        "read, calibrate, convert, fit (the layer-wise fit) and write one layer at a time (peak memory about one "
        "layer, not two models); no recovery or stage scores; needs --train-text",
    )

    @property
    def work(self) -> Path:
        return work_folder(self.out)

    @property
    def trains(self) -> bool:
        """Whether a stage trains (the layer-wise fit, the recovery)."""
        return self.finetune is not None or self.reconstruction.steps > 0

    @property
    def keeps_work(self) -> bool:
        """Whether the job writes work to resume from: a stage that trains, or the streamed pass (each layer)."""
        return self.trains or self.stream

    def __post_init__(self) -> None:
        check_fields(self)
        if isinstance(self.source, (str, Path)):
            source_config(self.source)  # a source that does not resolve, or that EG-MLA cannot convert
        if self.options.rope_split == "auto" and self.text.calibration_blocks < 2:
            raise ValueError(
                "the split search (--rope-split auto) holds out a calibration block to compare on: give "
                "--calibration-blocks 2 or more, or choose --rope-split."
            )
        check_trainable_dtype(
            self.placement, self.trains, "--reconstruction-steps 0 --steps 0 for a closed-form conversion"
        )
        if self.resume:
            check_resumable(self)


# Set aside after the recovery: scoring the saved model (a little more than the source's scoring took in SmolLM2's
# runs), and a fixed allowance for the decode measurement, the sample, the save and the recovery's own timing passes (SmolLM2 on 2 cores).
FINAL_SCORING_FACTOR = 1.35
FINAL_STAGES_SECONDS = 45.0
MIN_RECOVERY_MINUTES = 0.25  # less would be spent on the recovery's set-up and timing passes


def recovery_deadline(job: ConversionJob, started: float, scoring_seconds: float) -> float | None:
    """When the recovery must end for the job to keep its time limit: the final stages, timed from the source's
    scoring, are set aside. None without a limit."""
    if job.time_limit is None:
        return None
    return started + job.time_limit * 60 - FINAL_SCORING_FACTOR * scoring_seconds - FINAL_STAGES_SECONDS


def recovery_within_limit(settings: FinetuneSettings, deadline: float | None, limit: float) -> FinetuneSettings | None:
    """The recovery's settings with `max_minutes` cut to what remains before `deadline` (of the job's `limit`
    minutes); None when too little does."""
    if deadline is None:
        return settings
    remaining = (deadline - time.time()) / 60
    if remaining < MIN_RECOVERY_MINUTES:
        print(f"no time left for the recovery within the {limit:g}-minute limit: skipped")
        return None
    if settings.max_minutes is not None and settings.max_minutes <= remaining:
        return settings
    print(f"recovering for {remaining:.1f} minutes: what remains of the {limit:g}-minute limit")
    return dataclasses.replace(settings, max_minutes=round(remaining, 2))


@dataclass
class Fitting:
    """What the fitting stages left: the model kept, the stage selection, the layer-wise errors, the recovery."""

    student: torch.nn.Module
    stages: StageSelection
    layers: list[dict]
    finetune: dict | None = None


def fit_stages(student: EGMLAForCausalLM, source, job: ConversionJob, text: TextData, passed: LayerPass,
               scores: dict, deadline: float | None, times: StageTimes) -> Fitting:  # fmt: skip
    """The stages after the layer pass, each kept only if it lowers the loss on the blocks held aside: the pass's
    layer-wise fit (`student` is in closed form), then the recovery (within the time limit's `deadline`); with
    `job.score_stages`, each stage's held-out scores are added to `scores`."""
    if job.score_stages:
        add_scores(scores, score_documents({"zero-shot": student}, text, source))
    stages = StageSelection(text.selection, text.bf16_scoring)
    stages.consider("zero-shot", student)
    if passed.rows:
        _, unexpected = student.load_state_dict(passed.sink.fitted, strict=False)
        assert not unexpected, unexpected
        passed.sink.fitted.clear()  # the student holds them now
        if job.score_stages:
            add_scores(scores, score_documents({"layer-wise": student}, text, source))
        stages.consider("layer-wise", student)
    settings = recovery_settings(job.finetune, text) if job.finetune is not None else None
    if settings is not None:
        settings = recovery_within_limit(settings, deadline, job.time_limit)
    if settings is None:  # no recovery asked for, or none left within the time limit (then the report says so)
        skipped = None if job.finetune is None else {"skipped": "time limit", "time_limit": job.time_limit}
        return Fitting(student, stages, passed.rows, skipped)
    checkpoints = job.work / "recovery"  # a killed run's recovery resumes from its last checkpoint
    resumes = saved_checkpoint(checkpoints) is not None
    settings = dataclasses.replace(settings, checkpoint_dir=checkpoints, resume=resumes)
    with times.stage("recovery"):
        result = finetune(student, source, text.recovery, settings, text.held_out)
    if job.score_stages:
        add_scores(scores, score_documents({"fine-tuned": result.model}, text, source))
    stages.consider("fine-tuned", result.model)
    return Fitting(result.model, stages, passed.rows, {**result_summary(result), **public_settings(settings)})


def load_source(job: ConversionJob, times: StageTimes) -> tuple:
    """(the source model, its tokenizer, the job's `TextData`): the tokenizer checked before the weights load."""
    with times.stage("load"):
        tokenizer = load_tokenizer(job.source)
        check_tokenizer(tokenizer, source_config(job.source), job.source)
        source = load_llama(job.source, job.placement)
        text = prepare_text(source, tokenizer, job.text)
    return source, tokenizer, text


def layer_pass(job: ConversionJob, source, text: TextData, times: StageTimes) -> tuple[LayerPass, EGMLAForCausalLM]:
    """The conversion's layer pass over the model in memory, and the student it leaves in closed form (the gate on
    K/V fitted where asked for; the layer-wise fit's layers are kept in the pass's sink)."""
    check_options(source.config, job.options)  # before any work is written
    work = start_work(job)  # the pass and the fitting stages write what a killed run resumes from
    folder = None if work is None else WorkFolder(work)
    held = HeldLayers(None if folder is None else folder.shards, source.dtype)
    calibration = text.fit[: job.text.calibration_blocks]
    passed = run_pass(ModelLayers(source), job, PassText(calibration, text.recovery.shape[1]), held, folder, times)
    student = assemble(source, student_config(source, passed.plan), held.closed_form, job.options.seed)
    held.closed_form.clear()  # the student holds them now
    if not passed.rows:
        held.fitted.clear()  # nothing fitted: the closed form's tensors
    warning = rebuild_warning(student.config, source.config)
    if warning:
        print(warning)
    return passed, student


def measure_output(report: ConversionReport, source, student, tokenizer, job: ConversionJob, text: TextData) -> None:
    """The report's measurements of the saved model beside its source: its cache on `generate`'s caches, its decode
    cost and a timed step, and (with a prompt) greedy continuations side by side."""
    report.kv = kv_report(source, student, text.held_out[:2, :32])
    report.decode = {
        "arithmetic": cost_row(egmla_cost(student.config), source_cost(source.config)),
        "source_arithmetic": cost_row(source_cost(source.config), source_cost(source.config)),
        "measured": measure_decode(source, student),
    }
    if job.sample_prompt:
        report.samples = side_by_side({"source": source, "converted": student}, tokenizer, job.sample_prompt)


def run_conversion(job: ConversionJob) -> ConversionReport:
    """Convert (and optionally fine-tune), evaluate, report and save a Hub-ready folder atomically."""
    inputs = (split_gguf(job.source)[0],)
    check_output_folder(job.out, job.overwrite, inputs)  # before any long work
    card = job_card(job)  # read before too
    started, times = time.time(), StageTimes()
    source, tokenizer, text = load_source(job, times)
    memory = check_memory(source, memory_shape(job, text, source), job.force)  # before the long stages
    passed, student = layer_pass(job, source, text, times)
    plan = passed.plan
    with times.stage("scoring"):
        scores = score_documents({"source": source}, text, source)
    deadline = recovery_deadline(job, started, scoring_seconds=times.seconds["scoring"])
    fitting = fit_stages(student, source, job, text, passed, scores, deadline, times)
    student, saved_stage = fitting.student, fitting.stages.saved_stage
    if saved_stage not in scores["perplexity"]:  # the saved model is always scored
        with times.stage("scoring"):
            add_scores(scores, score_documents({saved_stage: student}, text, source))
    report = ConversionReport(
        source=public_name(job.source),
        options=asdict(plan.options),
        budget={**asdict(plan.budget), "kv_lora_rank": student.config.kv_lora_rank,
                **families.windowed_layers(student.config)},  # fmt: skip
        reconstruction={**asdict(job.reconstruction), "gate": passed.gate_rows, "layers": fitting.layers},
        placement={"device": str(source.device), "dtype": job.placement.dtype},
        candidates=plan.candidates, text=text.description, scores=scores, stages=fitting.stages.rows,
        saved_stage=saved_stage, finetune=fitting.finetune, time_limit=job.time_limit, card=card,
        memory={"predicted_peak_gb": round(memory.peak / GB, 2), "activations_gb": round(memory.activations / GB, 2)},
    )  # fmt: skip
    with times.stage("decode measurement"):
        measure_output(report, source, student, tokenizer, job, text)
    report.seconds, report.stage_seconds = round(time.time() - started, 1), times.seconds
    with atomic_folder(job.out, job.overwrite, inputs) as staging:
        student.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        write_model_card(staging, report)
    shutil.rmtree(job.work, ignore_errors=True)  # saved: nothing left to resume
    print_report(report)
    print(f"\nsaved {job.out} ({report.seconds} s)")
    return report


def memory_shape(job: ConversionJob, text: TextData, source: torch.nn.Module) -> MemoryShape:
    """What the memory estimate reads of a job: its recovery's batch and length, what it trains, its autocast."""
    settings = job.finetune
    samples = max((len(sample) for sample in text.source_samples), default=0)
    if settings is None:
        return MemoryShape(0, 0, False, text.bf16_scoring, samples)
    bf16 = uses_bf16(settings.mixed_precision, source.device, source.config.hidden_size)
    batch = recovery_settings(settings, text).batch_size  # the blocks of a step, packed to the recovery's length
    return MemoryShape(batch, text.recovery.shape[1], not settings.lora, bf16, samples)


def kv_report(source: torch.nn.Module, student: torch.nn.Module, prompt: torch.Tensor) -> dict:
    """K/V values per token per layer, read off the caches of real `generate` calls before and after."""
    before, after = kv_values_per_token(source, prompt), kv_values_per_token(student, prompt)
    return {
        "source": before["values_per_token_per_layer"],
        "converted": after["values_per_token_per_layer"],
        "converted_token_id_bytes": after["token_id_bytes_per_token"],
        "converted_position_bytes": after["position_bytes_per_token"],
    }


def comparison_prompts(tokenizer, prompt: str) -> list[list[int]]:
    """The given prompt, then one of the sampler's requests (a chat source's) and one of its openings."""
    prompts = source_prompts(tokenizer)
    request = [prompts[len(OPENINGS)]] if len(prompts) > len(OPENINGS) else []
    return [tokenizer.encode(prompt), *request, prompts[2]][:3]


@torch.no_grad()
def side_by_side(models: dict[str, torch.nn.Module], tokenizer, prompt: str, new_tokens: int = 48) -> list[dict]:
    """Each model's greedy continuation of the same prompts (the given one; for a chat source, requests in its
    template too), with the share of repeated 4-grams in what it added: a converted model should not loop where
    its source does not."""
    rows = []
    for ids in comparison_prompts(tokenizer, prompt):
        row = {"prompt": tokenizer.decode(ids, skip_special_tokens=True)}
        for name, model in models.items():
            inputs = torch.tensor([ids], device=model.device)
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                                 do_sample=False)[0, len(ids) :]  # fmt: skip
            text = tokenizer.decode(out, skip_special_tokens=True)
            row[name] = {"text": text, "repeated_4grams": round(repeated_ngram_share(out), 3)}
        rows.append(row)
    return rows


def public_settings(settings: FinetuneSettings) -> dict:
    """The settings as a report holds them: the checkpoint folder by its name, not its local path."""
    return {**settings_summary(settings), "checkpoint_dir": public_name(settings.checkpoint_dir)}


def result_summary(result) -> dict:
    return {
        "steps_done": result.steps_done,
        "steps_planned": result.steps_planned,
        "seconds": round(result.seconds, 1),
        "stopped_early": result.stopped_early,
        "distilled_tokens": result.distilled_tokens,
    }


@dataclass
class FinetuneJob:
    """One `egmla finetune`: a converted folder recovered by distillation from its source."""

    student: str
    teacher: str
    out: Path
    text: TextSettings
    settings: FinetuneSettings
    overwrite: bool = option(False, "replace OUT if it exists")
    base_model: str | None = option(
        None, "the card's base_model, a Hub id (default: the student's card's, else the teacher's Hub id)"
    )
    license: str | None = option(None, "the card's licence (default: the student's card's, else the teacher's)")
    placement: Placement = Placement()

    def __post_init__(self) -> None:
        student = read_config(self.student, "student")
        if student.model_type != "egmla":
            raise ValueError(
                f"The student {self.student} is a {student.model_type!r} checkpoint: give a folder that "
                "`egmla convert` wrote."
            )
        check_teacher(student, source_config(self.teacher), self.teacher)
        check_trainable_dtype(self.placement, True, "convert the student to bfloat16 first")
        resume_checkpoint(self.settings)  # --resume with nothing to resume from


def check_trainable_dtype(placement: Placement, trains: bool, instead: str) -> None:
    """float16 weights trained without a loss scaler lose their small gradients: only bf16 and fp32 train here."""
    if trains and placement.dtype == "float16":
        raise ValueError(
            "--dtype float16 would train (the layer-wise fit, the recovery) without loss scaling, losing small "
            f"gradients: use --dtype bfloat16 or float32, or {instead}."
        )


SHARED_SHAPE = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")


def check_teacher(student, teacher, name: str | Path) -> None:
    """The teacher must be the student's source: a conversion keeps its embeddings, widths and MLPs."""
    for field_name in SHARED_SHAPE:
        theirs, ours = getattr(teacher, field_name), getattr(student, field_name)
        if theirs != ours:
            raise ValueError(
                f"--teacher {name} is not the student's source: its {field_name} is {theirs}, the student's "
                f"{ours}. Give the checkpoint the student was converted from."
            )


def run_finetune(job: FinetuneJob) -> dict:
    """Fine-tunes a converted folder against its source and saves the result atomically."""
    inputs = (job.student, split_gguf(job.teacher)[0])
    check_output_folder(job.out, job.overwrite, inputs)
    teacher_metadata = source_metadata(job.teacher)
    student_metadata = source_metadata(job.student)  # a converted folder's card names its source
    device, dtype = job.placement.torch_device(), job.placement.torch_dtype
    tokenizer = load_tokenizer(job.teacher)
    check_tokenizer(tokenizer, read_config(job.student, "student"), job.teacher)
    student = AutoModelForCausalLM.from_pretrained(job.student, dtype=dtype, device_map=device)
    check_finite(student, "The student's")
    teacher = load_llama(job.teacher, job.placement)
    text = prepare_text(teacher, tokenizer, job.text)
    scores = score_documents({"before": student}, text, teacher)
    stages = StageSelection(text.selection, text.bf16_scoring)
    stages.consider("before", student)
    settings = recovery_settings(job.settings, text)
    result = finetune(student, teacher, text.recovery, settings, text.held_out)
    add_scores(scores, score_documents({"after": result.model}, text, teacher))
    stages.consider("after", result.model)
    summary = {
        "student": public_name(job.student),
        "teacher": public_name(job.teacher),
        **text.description,
        **scores,
        "stages": stages.rows,
        "saved_stage": stages.saved_stage,
        **result_summary(result),
        "settings": public_settings(settings),
    }
    summary["card"] = {
        "base_model": job.base_model or student_metadata.base_model or teacher_metadata.base_model,
        "license": job.license or student_metadata.license or teacher_metadata.license,
        "language": student_metadata.language or teacher_metadata.language,
        "model_name": Path(job.out).name,
        "eval_dataset": held_out_dataset(job.text),
    }
    state = PartialState()  # under `accelerate launch`, every process trained the same model: one writes it
    if state.is_main_process:
        with atomic_folder(job.out, job.overwrite, inputs) as staging:
            result.model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            (staging / "finetune_report.json").write_text(report_json(summary))
            write_finetune_card(staging, summary)
        kept = "" if stages.saved_stage == "after" else " (not kept: it raised the loss on the blocks held aside)"
        print(
            f"held-out perplexity {summary['perplexity']['before']:.3f} -> {summary['perplexity']['after']:.3f}"
            f"{kept}; saved {job.out}"
        )
    state.wait_for_everyone()
    return summary


def run_ppl(
    model_path: str,
    eval_text: Path,
    block_size: int = 256,
    max_blocks: int | None = None,
    placement: Placement | None = None,
) -> float:
    """Perplexity of a model folder (Llama or EG-MLA) or `.gguf` file over the token blocks of a text."""
    check_text_file("--eval-text", Path(eval_text))
    check_bounds("block_size (--block-size)", block_size, "[2, inf)")
    if max_blocks is not None:
        check_bounds("max_blocks (--max-blocks)", max_blocks, "[1, inf)")
    tokenizer = load_tokenizer(model_path)
    check_tokenizer(tokenizer, read_config(model_path, "model"), model_path)
    folder, gguf_file = split_gguf(model_path)
    placement = placement or Placement()
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf_file, dtype=placement.torch_dtype, device_map=placement.torch_device()
    )
    check_finite(model, "The model's")
    blocks = token_blocks(tokenizer, read_documents(eval_text), block_size, source=str(eval_text))
    blocks = blocks[:max_blocks] if max_blocks else blocks
    value = perplexity(model, blocks, progress=True)
    print(f"perplexity {value:.4f} ({math.log(value):.4f} nats/token) over {blocks.numel():,} tokens")
    return value
