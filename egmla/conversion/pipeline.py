"""The jobs behind `egmla retrofit` (the main job), `egmla convert`, `egmla finetune` and `egmla ppl`."""

import dataclasses
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM

from ..data import EXCERPT, WIKIPEDIA_HELD_OUT
from ..hub import public_name, source_metadata, text_dataset
from ..measure import kv_values_per_token
from ..modeling_egmla import EGMLAForCausalLM
from ..options import Placement, check_bounds, check_fields, check_text_file, option
from ..outputs import atomic_folder, check_output_folder, report_json
from ..sampling import OPENINGS, Sampling, repeated_ngram_share, sample_blocks, sample_documents, source_prompts
from ..text import (
    document_ids,
    document_perplexity,
    mean_loss,
    packed_blocks,
    perplexity,
    position_buckets,
    read_documents,
    sample_agreement,
    split_documents,
    token_blocks,
)
from ..training import (
    MIXED_PRECISIONS,
    FinetuneSettings,
    bf16_autocast,
    finetune,
    resume_checkpoint,
    saved_checkpoint,
    settings_summary,
    uses_bf16,
)
from .calibration import FITTED_CONTEXT
from .convert import ConversionOptions, build_student
from .decode_cost import cost_row, egmla_cost, measure_decode, rebuild_warning, source_cost
from .gate import fit_gate
from .memory import GB, MemoryShape, check_memory
from .plan import plan_conversion
from .reconstruction import FittedLayers, ReconstructionSettings, reconstruct_layers
from .report import print_report, write_finetune_card, write_model_card
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

# `egmla retrofit`'s settings by whether text is given (a flag given wins). With text: a short layer-wise fit, then
# the attention alone recovered (its steps are cheaper than the whole model's, and it ended nearer the source in the
# same time). Data-free: a longer fit and the whole model recovered at a lower rate, since on sampled text both of
# the text's choices ended worse (docs/results.md#behind-the-defaults).
RETROFIT_BY_TEXT = {
    "text": {
        "max_minutes": 7.0,
        "reconstruction_steps": 100,
        "reconstruction_batch_size": 4,  # as measured (2 packed blocks a step); convert's default is half that
        "attention_only": True,
        "learning_rate": 2e-4,
    },
    "data-free": {
        "max_minutes": 4.5,
        "reconstruction_steps": 200,
        "reconstruction_batch_size": 4,  # 128-token sampled blocks packed to 512: one a step
        "attention_only": False,
        "learning_rate": 1e-4,
    },
}
# The main job (no source given) keeps its minutes on a slower machine too: its recovery is shortened to fit.
MAIN_JOB_TIME_LIMITS = {"text": 20.0, "data-free": 15.0}
# The main job's defaults where they differ from the dataclasses': MHA2MLA's cut of SmolLM2-135M, sized to
# finish within 15 minutes on 2 CPU cores (20 with text); the settings that follow the text are in RETROFIT_BY_TEXT.
RETROFIT_DEFAULTS = {
    "kv_cut": 0.6875,
    "sampled_block_size": 128,
    "sampled_blocks": 128,
    "steps": None,
    "batch_size": 4,
    "mixed_precision": "auto",
    "calibration_blocks": 64,  # as its figures were measured
    **dict.fromkeys(RETROFIT_BY_TEXT["text"]),  # None: chosen by whether text is given, unless a flag is
}
# `egmla convert` recovers on the calibration text when one is given (`--steps 0` turns it off): a decoupled rope
# key loses what only training on text gives back, and a few minutes of it are most of the gain. 4 of them keep
# SmolLM2's conversion with text within 10 minutes on 2 cores; longer runs gained a little for more time (docs/results.md#behind-the-defaults).
CONVERT_DEFAULTS = {
    "steps": None,
    "batch_size": 4,
    "learning_rate": 2e-4,
    "max_minutes": 4.0,
    "mixed_precision": "auto",
}


@dataclass
class TextSettings:
    """Where fitting and held-out text come from."""

    train_text: Path | None = option(
        None,
        "<|endoftext|>-separated text for calibration and fitting; without it, text is sampled from the source",
        flags=("--calib-text",),
        input_file=True,
    )
    eval_text: Path | None = option(
        None, "held-out text (default: the last 10% of the fitting text, or the embedded excerpt)", input_file=True
    )
    block_size: int = option(256, "tokens per block cut from the fitting text", bounds="[2, inf)")
    sampled_block_size: int = option(
        256, "tokens per block sampled from the source when no text is given", bounds="[2, inf)"
    )
    # At the same tokens per step: the fitted length is what a model is good at.
    recovery_block_size: int | None = option(
        None,
        "tokens per recovery block, the fitting blocks packed (default: the source's context, at most 512)",
        bounds="[2, inf)",
    )
    # 32 (8,192 tokens): SmolLM2 converted with the defaults ended nearer its source than with 64, and sooner (the
    # layer-wise fit's passes over every block halve; docs/results.md#behind-the-defaults).
    calibration_blocks: int = option(
        32,
        "blocks of fitting text used to calibrate and to fit layer by layer",
        flags=("--calib-blocks",),
        bounds="[1, inf)",
    )
    sampled_blocks: int = option(
        64, "blocks sampled from the source: the fitting text when no text is given", bounds="[1, inf)"
    )
    sample_temperatures: tuple[float, ...] = option(
        (0.7, 0.85, 1.0), "temperatures the source's samples cycle through, batch by batch", bounds="(0, inf)"
    )
    # Half: kept on the choosing half of the general English excerpt and the source's samples (docs/results.md).
    source_sample_share: float = option(
        0.5,
        "with --train-text, the share of the first fitting blocks (calibration, layer-wise fit, recovery) that are "
        "--sampled-blocks of the source's own text, interleaved with the user's (0: the user's text alone)",
        bounds="[0, 1)",
    )
    replay_samples: bool = option(
        False,
        "recovery replays the source's samples at --source-sample-share through all of the user's text (where its "
        "batches are drawn), not only among the first blocks: nearer the source beyond the text, further on it",
    )
    held_aside_samples: int = option(
        24,
        "samples of the source held aside from every stage: the report's perplexity and KL to the source on them",
        bounds="[0, inf)",
    )
    extra_eval_text: tuple[Path, ...] = option(
        (WIKIPEDIA_HELD_OUT,),
        "more held-out texts, each scored whole and named in the report (default: the embedded general English "
        "excerpt, Wikipedia; give the flag with no file for none)",
        input_file=True,
    )
    eval_blocks: int = option(64, "held-out blocks scored during fine-tuning", bounds="[1, inf)")
    eval_documents: int = option(
        100, "held-out documents scored whole (up to the source's context) for the report", bounds="[1, inf)"
    )
    # bf16 scores faster, its perplexity within rounding of float32's, where the CPU computes bf16 (docs/results.md#behind-the-defaults).
    scoring_mixed_precision: str = option(
        "auto",
        "the held-out documents scored under bfloat16 autocast (auto: where the device computes bfloat16 natively "
        "and the model is 512 wide or more)",
        MIXED_PRECISIONS,
    )
    seed: int = option(0, "of sampling, the gate tables, training")

    def __post_init__(self) -> None:
        self.sample_temperatures, self.extra_eval_text = tuple(self.sample_temperatures), tuple(self.extra_eval_text)
        check_fields(self)
        if not self.sample_temperatures:
            raise ValueError("sample_temperatures (--sample-temperatures) needs at least one temperature.")


MAX_RECOVERY_BLOCK = FITTED_CONTEXT  # the default recovery length: longer blocks cost more than their tokens on a CPU
SELECTION_TOKENS = 4096  # at most: fitting text held aside from every stage, to decide which stages are kept


@dataclass
class TextData:
    fit: torch.Tensor
    recovery: torch.Tensor  # the fitting blocks packed to the recovery length
    selection: torch.Tensor  # fitting text no stage fits on, packed as recovery blocks (never the report's text)
    held_out: torch.Tensor  # blocks [N, block_size], for the evaluations during fine-tuning
    documents: list[torch.Tensor]  # whole held-out documents up to the source's context, for the report
    description: dict = field(default_factory=dict)
    extra_documents: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # more held-out texts, by name
    source_samples: list[torch.Tensor] = field(default_factory=list)  # the source's own, held aside from fitting
    bf16_scoring: bool = False  # the documents scored under bfloat16 autocast


def read_calibration_text(path: Path, holds_out: bool) -> list[str]:
    """The documents of a calibration text, refused by name when there is nothing to fit (or to hold out)."""
    documents = read_documents(path)
    if not documents:
        raise ValueError(f"The calibration text {path} is empty: give documents separated by <|endoftext|>.")
    if holds_out and len(documents) < 2:
        raise ValueError(
            f"The calibration text {path} holds {len(documents)} document: the last 10% of the documents are held "
            "out to measure the conversion, so give several (separated by <|endoftext|>), or --eval-text."
        )
    return documents


def split_train_text(settings: TextSettings) -> tuple[list[str], list[str] | None]:
    """The fitting documents of the calibration text and, without an eval text, its held-out last tenth (None when
    an eval text is given)."""
    documents = read_calibration_text(settings.train_text, settings.eval_text is None)
    if settings.eval_text is not None:
        return documents, None
    return split_documents(documents, 0.1)


def fitting_and_held_out(settings: TextSettings) -> tuple[list[str], list[str], str]:
    """(the fitting documents, the held-out documents, where the held-out ones come from) of a calibration text."""
    documents, held_out = split_train_text(settings)
    if held_out is not None:
        return documents, held_out, f"the last 10% of the documents of {public_name(settings.train_text)}"
    return documents, read_documents(settings.eval_text), public_name(settings.eval_text)


def recovery_length(settings: TextSettings, context: int) -> int:
    """Tokens per recovery block (and per block of the layer-wise fit): as asked, else the source's context up to
    `MAX_RECOVERY_BLOCK`."""
    return settings.recovery_block_size or min(context, MAX_RECOVERY_BLOCK)


def sampling(settings: TextSettings, seed_offset: int = 0) -> Sampling:
    """The settings' sampling of the source; how much to sample is the caller's (`sample_blocks` sizes it)."""
    return Sampling(tokens=0, temperatures=settings.sample_temperatures, seed=settings.seed + seed_offset)


def interleaved(text: torch.Tensor, sampled: torch.Tensor, share: float, replay: bool = False) -> torch.Tensor:
    """Blocks of the user's text with the source's samples among them, `share` of every run of blocks: among the
    first of them until the samples are used up, the rest of the text after; with `replay`, the samples cycled so
    that the share holds through all of the text."""
    order, used_text, used_sampled = [], 0, 0
    while (replay or used_sampled < len(sampled)) and used_text < len(text):
        if used_sampled < share * (used_text + used_sampled + 1):
            order.append(sampled[used_sampled % len(sampled)])
            used_sampled += 1
        else:
            order.append(text[used_text])
            used_text += 1
    return torch.cat([torch.stack(order), text[used_text:]]) if order else text


class FittingText(NamedTuple):
    """The fitting text's blocks [N, S]: the user's (or, data-free, the source's samples), and the source's samples
    mixed in beside a user's text (None without)."""

    blocks: torch.Tensor
    sampled: torch.Tensor | None
    held_out: tuple[list[str], str] | None  # the user's held-out documents and where they are from; None data-free
    description: str


def fitting_blocks(teacher, tokenizer, settings: TextSettings) -> FittingText:
    """The fitting text: the user's blocks and the source's samples, or (data-free) the samples alone."""
    if settings.train_text is None:
        size, count = settings.sampled_block_size, settings.sampled_blocks
        fit = sample_blocks(teacher, tokenizer, count, size, sampling(settings))
        temperatures = "/".join(f"{t:g}" for t in settings.sample_temperatures)
        return FittingText(
            fit, None, None, f"{len(fit)} x {size} tokens sampled from the source at {temperatures} (data-free)"
        )
    documents, held_out, eval_source = fitting_and_held_out(settings)
    fit = token_blocks(tokenizer, documents, settings.block_size, source=f"--train-text {settings.train_text}")
    source = public_name(settings.train_text)
    if settings.source_sample_share == 0:
        return FittingText(fit, None, (held_out, eval_source), source)
    sampled = sample_blocks(teacher, tokenizer, settings.sampled_blocks, settings.block_size, sampling(settings))
    share = settings.source_sample_share
    where = "of the first blocks, replayed through recovery" if settings.replay_samples else "of the first blocks"
    source += f", with {len(sampled)} blocks sampled from the source ({share:.0%} {where})"
    return FittingText(fit, sampled, (held_out, eval_source), source)


def mixed(fitting: FittingText, share: float, replay: bool = False) -> torch.Tensor:
    """The fitting blocks with the source's samples interleaved at `share`, if there are any."""
    if fitting.sampled is None:
        return fitting.blocks
    return interleaved(fitting.blocks, fitting.sampled, share, replay)


def extra_documents(tokenizer, settings: TextSettings, context: int) -> dict[str, list[torch.Tensor]]:
    """Every extra held-out text's documents, whole up to the source's `context`, by the text's name."""
    count = settings.eval_documents
    return {
        public_name(path): document_ids(tokenizer, read_documents(path)[:count], context)
        for path in settings.extra_eval_text
    }


def held_aside_samples(teacher, tokenizer, settings: TextSettings) -> list[torch.Tensor]:
    """The source's samples no stage fits on (another seed than every fitting sample's), a batch per temperature."""
    count, temperatures = settings.held_aside_samples, len(settings.sample_temperatures)
    if not count:
        return []
    aside = sampling(settings, seed_offset=1_000_003)
    aside = dataclasses.replace(aside, samples=count, batch_size=max(1, -(-count // temperatures)))
    return sample_documents(teacher, tokenizer, aside)


def prepare_text(teacher, tokenizer, settings: TextSettings) -> TextData:
    context = teacher.config.max_position_embeddings
    # The source is sampled under the scoring's autocast: bf16 where the device computes it natively.
    bf16_scoring = uses_bf16(settings.scoring_mixed_precision, teacher.device, teacher.config.hidden_size)
    with bf16_autocast(teacher.device, bf16_scoring):
        fitting = fitting_blocks(teacher, tokenizer, settings)
        samples = held_aside_samples(teacher, tokenizer, settings)
    if fitting.held_out is None:
        eval_path = settings.eval_text or EXCERPT
        held_out_documents, eval_source = read_documents(eval_path), public_name(eval_path)
    else:
        held_out_documents, eval_source = fitting.held_out
    named = f"The held-out text ({eval_source})"
    held_out = token_blocks(tokenizer, held_out_documents, settings.block_size, source=named)[: settings.eval_blocks]
    documents = document_ids(tokenizer, held_out_documents[: settings.eval_documents], context)
    extra = extra_documents(tokenizer, settings, context)
    length = recovery_length(settings, context)
    # The last of the user's blocks (the samples' when data-free) decide which stages are kept: no stage fits them.
    blocks = fitting.blocks
    aside = min(-(-SELECTION_TOKENS // blocks.shape[1]), len(blocks) // 8)
    fitting, selection = fitting._replace(blocks=blocks[: len(blocks) - aside]), blocks[len(blocks) - aside :]
    # Calibration and the layer-wise fit take the first blocks, `source_sample_share` of them samples; recovery
    # draws its batches from all of the text, where only `replay_samples` keeps the share.
    fit = mixed(fitting, settings.source_sample_share)
    recovery = packed_blocks(mixed(fitting, settings.source_sample_share, settings.replay_samples), length)
    selection = packed_blocks(selection, length) if aside * blocks.shape[1] >= length else selection
    description = {
        "fit_text": fitting.description,
        "recovery_block_size": recovery.shape[1],
        "eval_text": eval_source,
        "eval_documents": len(documents),
        "eval_tokens": sum(len(document) - 1 for document in documents),
        "eval_context": context,
        "selection_blocks": len(selection),
        "extra_eval_text": {name: len(ids) for name, ids in extra.items()},
        "held_aside_samples": len(samples),
    }
    description["scoring_autocast"] = "bf16" if bf16_scoring else None
    return TextData(
        fit, recovery, selection, held_out, documents, description, extra_documents=extra, source_samples=samples,
        bf16_scoring=bf16_scoring,
    )  # fmt: skip


def held_out_dataset(settings: TextSettings) -> tuple[str, str]:
    """The held-out text as a `model-index` dataset (type, file name)."""
    return text_dataset(settings.eval_text or settings.train_text or EXCERPT)


def recovery_settings(settings: FinetuneSettings, text: TextData) -> FinetuneSettings:
    """`batch_size` counts fitting blocks: packed into longer recovery blocks, a step keeps its tokens."""
    packing = text.recovery.shape[1] // text.fit.shape[1]
    return dataclasses.replace(settings, batch_size=max(1, settings.batch_size // packing))


def layer_wise_inputs(
    calibration: torch.Tensor, length: int, settings: ReconstructionSettings
) -> tuple[torch.Tensor, ReconstructionSettings]:
    """The layer-wise fit sees the calibration blocks packed to the recovery `length` (the distances the model must
    serve), at the same tokens per step."""
    blocks = packed_blocks(calibration, length) if calibration.numel() >= length else calibration
    packing = blocks.shape[1] // calibration.shape[1]
    return blocks, dataclasses.replace(settings, batch_size=max(1, settings.batch_size // packing))


def score_documents(models: dict[str, torch.nn.Module], text: TextData, source: torch.nn.Module) -> dict:
    """Held-out perplexity of each model over whole documents (the report's figures), overall and per position; on
    every extra held-out text; and on the source's samples held aside, with the KL from the source's predictions."""
    edges = position_buckets(text.description["eval_context"])
    scores = {"perplexity": {}, "perplexity_by_position": {}, "extra_perplexity": {}, "source_samples": {}}
    for name, model in models.items():
        with bf16_autocast(model.device, text.bf16_scoring):
            score = document_perplexity(model, text.documents, edges, progress=True)
            scores["perplexity"][name], scores["perplexity_by_position"][name] = score["perplexity"], score["buckets"]
            scores["extra_perplexity"][name] = {
                text_name: document_perplexity(model, documents, edges)["perplexity"]
                for text_name, documents in text.extra_documents.items()
            }
            if text.source_samples:
                scores["source_samples"][name] = sample_agreement(model, source, text.source_samples)
    return scores


@dataclass
class StageSelection:
    """Never worse than an earlier stage: each fitting stage is kept only if it lowers the next-token loss on the
    blocks held aside from all fitting; otherwise the model is put back to the best stage so far. Without such
    blocks (a text of fewer than 8 blocks) every stage is kept, and the report says so."""

    blocks: torch.Tensor
    bf16: bool = False  # the losses under bfloat16 autocast, as the held-out scoring (`TextData.bf16_scoring`)
    rows: list[dict] = field(default_factory=list)
    best_loss: float = math.inf
    best_state: dict | None = None

    def consider(self, stage: str, model: torch.nn.Module) -> bool:
        with bf16_autocast(next(model.parameters()).device, self.bf16):
            loss = mean_loss(model, self.blocks) if len(self.blocks) else None
        if loss is not None and not math.isfinite(loss):
            loss = math.inf
        kept = loss is None or self.best_state is None or loss < self.best_loss
        if kept and loss is not None:
            self.best_loss = loss
            # On the host: the accelerator holds the model being fitted, not its copies.
            self.best_state = {
                name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()
            }
        elif not kept:
            model.load_state_dict(self.best_state)
        self.rows.append({"stage": stage, "selection_loss": loss, "kept": kept})
        return kept

    @property
    def saved_stage(self) -> str:
        return [row["stage"] for row in self.rows if row["kept"]][-1]


def add_scores(scores: dict, more: dict) -> None:
    """Merges a later stage's `score_documents` into the earlier stages' (both keyed by figure, then model)."""
    for figure, by_model in more.items():
        scores[figure].update(by_model)


@dataclass
class ConversionJob:
    """One `egmla convert` or `egmla retrofit`: what to convert, how, on which text, and whether to fine-tune."""

    source: str
    out: Path
    options: ConversionOptions
    text: TextSettings
    reconstruction: ReconstructionSettings = ReconstructionSettings()
    finetune: FinetuneSettings | None = None  # None: convert only
    overwrite: bool = False
    sample_prompt: str | None = None
    # Held-out scores of every stage, not only of the source and the saved model (2 minutes a stage on SmolLM2).
    score_stages: bool = False
    base_model: str | None = None  # the card's base model (a Hub id); None: the source's own, when it names one
    license: str | None = None  # the card's licence; None: the source's card, config or GGUF metadata, if any
    time_limit: float | None = None  # minutes for the whole job: the recovery gets what the other stages leave
    placement: Placement = Placement()  # the source's and the student's device and dtype (the output's dtype)
    resume: bool = False  # continue a killed run of the same job from its work folder
    force: bool = False  # run even where the memory estimate says it will not fit
    stream: bool = False  # one layer in memory at a time (`run_streaming_conversion`)

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
        if self.time_limit is not None:
            check_bounds("time_limit (--time-limit)", self.time_limit, "(0, inf)")
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


def fit_stages(
    student: EGMLAForCausalLM,
    teacher: torch.nn.Module,
    job: ConversionJob,
    text: TextData,
    calibration: torch.Tensor,
    scores: dict,
    deadline: float | None,
    times: StageTimes,
) -> Fitting:
    """The layer-wise fit, then the recovery (within the time limit's `deadline`), each kept only if it lowers the
    loss on the blocks held aside; with `job.score_stages`, each stage's held-out scores are added to `scores`."""
    if job.score_stages:
        add_scores(scores, score_documents({"zero-shot": student}, text, teacher))
    stages = StageSelection(text.selection, text.bf16_scoring)
    stages.consider("zero-shot", student)
    with times.stage("layer-wise fit"):
        inputs = layer_wise_inputs(calibration, text.recovery.shape[1], job.reconstruction)
        layers = reconstruct_layers(student, teacher, *inputs, fitted=FittedLayers(job.work / "layers"))
    if layers:
        if job.score_stages:
            add_scores(scores, score_documents({"layer-wise": student}, text, teacher))
        stages.consider("layer-wise", student)
    settings = recovery_settings(job.finetune, text) if job.finetune is not None else None
    if settings is not None:
        settings = recovery_within_limit(settings, deadline, job.time_limit)
    if settings is None:  # no recovery asked for, or none left within the time limit (then the report says so)
        skipped = None if job.finetune is None else {"skipped": "time limit", "time_limit": job.time_limit}
        return Fitting(student, stages, layers, skipped)
    checkpoints = job.work / "recovery"  # a killed run's recovery resumes from its last checkpoint
    resumes = saved_checkpoint(checkpoints) is not None
    settings = dataclasses.replace(settings, checkpoint_dir=checkpoints, resume=resumes)
    with times.stage("recovery"):
        result = finetune(student, teacher, text.recovery, settings, text.held_out)
    if job.score_stages:
        add_scores(scores, score_documents({"fine-tuned": result.model}, text, teacher))
    stages.consider("fine-tuned", result.model)
    return Fitting(result.model, stages, layers, {**result_summary(result), **public_settings(settings)})


def run_conversion(job: ConversionJob) -> dict:
    """Convert (and optionally fine-tune), evaluate, report and save a Hub-ready folder atomically."""
    inputs = (split_gguf(job.source)[0],)
    check_output_folder(job.out, job.overwrite, inputs)  # before any long work
    metadata = source_metadata(job.source, job.base_model, job.license)  # the card's, read before too
    started, times = time.time(), StageTimes()
    with times.stage("load"):
        tokenizer = load_tokenizer(job.source)
        check_tokenizer(tokenizer, source_config(job.source), job.source)  # before the weights load
        teacher = load_llama(job.source, job.placement)
        text = prepare_text(teacher, tokenizer, job.text)
    memory = check_memory(teacher, memory_shape(job, text, teacher), job.force)  # before the long stages
    calibration = text.fit[: job.text.calibration_blocks]
    plan, _ = plan_conversion(teacher, job.options, calibration, times)
    student = build_student(teacher, plan)
    warning = rebuild_warning(student.config, teacher.config)
    if warning:
        print(warning)
    gate = []
    if job.reconstruction.gate_init == "least_squares":
        with times.stage("gate fit"):
            gate = fit_gate(student, teacher, calibration, plan, job.reconstruction.gate_shrinkage)
    with times.stage("scoring"):
        scores = score_documents({"source": teacher}, text, teacher)
    deadline = recovery_deadline(job, started, scoring_seconds=times.seconds["scoring"])
    start_work(job)  # the fitting stages write what a killed run resumes from
    fitting = fit_stages(student, teacher, job, text, calibration, scores, deadline, times)
    student, stages, layers, finetune_summary = fitting.student, fitting.stages, fitting.layers, fitting.finetune
    if stages.saved_stage not in scores["perplexity"]:  # the saved model is always scored
        with times.stage("scoring"):
            add_scores(scores, score_documents({stages.saved_stage: student}, text, teacher))

    with times.stage("decode measurement"):
        measured = measure_decode(teacher, student)
    report = {
        "source": public_name(job.source),
        "options": asdict(plan.options),
        "budget": {**asdict(plan.budget), "kv_lora_rank": student.config.kv_lora_rank},
        "candidates": plan.candidates,
        "reconstruction": {**asdict(job.reconstruction), "gate": gate, "layers": layers},
        **text.description,
        "kv": kv_report(teacher, student, text.held_out[:2, :32]),
        **scores,
        "stages": stages.rows,
        "saved_stage": stages.saved_stage,
        "finetune": finetune_summary,
        "time_limit": job.time_limit,
        "placement": {"device": str(teacher.device), "dtype": job.placement.dtype},
        "memory": {
            "predicted_peak_gb": round(memory.peak / GB, 2),
            "activations_gb": round(memory.activations / GB, 2),
        },
        "decode": {
            "arithmetic": cost_row(egmla_cost(student.config), source_cost(teacher.config)),
            "source_arithmetic": cost_row(source_cost(teacher.config), source_cost(teacher.config)),
            "measured": measured,
        },
    }
    report["card"] = {
        **asdict(metadata),
        "model_name": Path(job.out).name,
        "eval_dataset": held_out_dataset(job.text),
    }
    if job.sample_prompt:
        report["samples"] = side_by_side({"source": teacher, "converted": student}, tokenizer, job.sample_prompt)
        report["sample"] = report["samples"][0]["prompt"] + report["samples"][0]["converted"]["text"]
    report["seconds"], report["stage_seconds"] = round(time.time() - started, 1), times.seconds

    with atomic_folder(job.out, job.overwrite, inputs) as staging:
        student.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        write_model_card(staging, report)
    shutil.rmtree(job.work, ignore_errors=True)  # saved: nothing left to resume
    print_report(report)
    print(f"\nsaved {job.out} ({report['seconds']} s)")
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


def kv_report(teacher: torch.nn.Module, student: torch.nn.Module, prompt: torch.Tensor) -> dict:
    """K/V values per token per layer, read off the caches of real `generate` calls before and after."""
    source, converted = kv_values_per_token(teacher, prompt), kv_values_per_token(student, prompt)
    return {
        "source": source["values_per_token_per_layer"],
        "converted": converted["values_per_token_per_layer"],
        "converted_token_id_bytes": converted["token_id_bytes_per_token"],
        "converted_position_bytes": converted["position_bytes_per_token"],
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
    }


@dataclass
class FinetuneJob:
    """One `egmla finetune`: a converted folder recovered by distillation from its source."""

    student: str
    teacher: str
    out: Path
    text: TextSettings
    settings: FinetuneSettings
    overwrite: bool = False
    base_model: str | None = None  # the card's base model; None: the student's card's, else the teacher's Hub id
    license: str | None = None  # the card's licence; None: the student's card's, else the teacher's
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


JOB_FILE = "job.json"
JOB_DEFAULTS = {"stream": False}


def work_folder(out: str | Path) -> Path:
    """Where a conversion keeps what a killed run resumes from (fitted layers, recovery checkpoints): beside OUT."""
    out = Path(out)
    return out.with_name(f".{out.name}.resume")


def job_description(job: "ConversionJob") -> dict:
    """What makes two runs the same job: a resumed run must not mix its work with another job's."""
    fields = ("source", "options", "text", "reconstruction", "finetune", "placement", "stream")
    return json.loads(json.dumps({name: getattr(job, name) for name in fields}, default=json_default))


def json_default(value: object) -> object:
    return asdict(value) if dataclasses.is_dataclass(value) else str(value)


def check_resumable(job: "ConversionJob") -> None:
    """A killed run of this very job to resume, or an error naming what is missing or different."""
    if not (job.work / JOB_FILE).is_file():
        raise ValueError(
            f"--resume: there is no killed run of {job.out} to resume ({job.work} does not exist); leave --resume out "
            "to start from the beginning."
        )
    saved, described = json.loads((job.work / JOB_FILE).read_text()), job_description(job)
    # A work folder written before a field existed holds that field's default.
    changed = sorted(name for name in described if saved.get(name, JOB_DEFAULTS.get(name)) != described[name])
    if changed:
        raise ValueError(
            f"--resume: the killed run in {job.work} was another job (its {', '.join(changed)} differ); give the same "
            "source and options, or leave --resume out to start again."
        )


def start_work(job: "ConversionJob") -> Path | None:
    """The job's work folder: kept as it is to resume it (checked when the job was built), else started empty; None
    when the job keeps no work, so there is nothing to resume."""
    work = job.work
    if not job.keeps_work:
        return None
    if job.resume:
        return work
    if work.exists():
        print(f"starting again: the work of a killed run in {work} is discarded (--resume would continue it)")
        shutil.rmtree(work)
    work.mkdir(parents=True)
    (work / JOB_FILE).write_text(json.dumps(job_description(job), indent=2))
    return work


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
