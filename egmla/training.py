"""Training EG-MLA models: recovery fine-tuning of a converted model (distillation from its source, KL on logits,
plus optional cross-entropy) and training from scratch (cross-entropy only), on all parameters or on LoRA adapters
(PEFT) with the gate tables trained in full.

Built on accelerate: one process here, `accelerate launch` for several. Checkpoints hold the accelerate state
(model, optimizer, scheduler, random generators) and the step; `resume=True` continues from the last one, and
the batch of every step is a function of (seed, step), so a resumed run sees the same data.
"""

import contextlib
import dataclasses
import hashlib
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from peft import LoraConfig, PeftModel, get_peft_model
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from .lora import LORA_TARGET_MODULES, gate_table_names
from .modeling_egmla import EGMLAForCausalLM
from .options import check_fields, option
from .precision import MIXED_PRECISIONS, fitting_autocast
from .text import loss_and_accuracy, token_blocks

STATE_FOLDER = "accelerate_state"
PROGRESS_FILE = "progress.json"
LAST_CHECKPOINT = "last"  # the checkpoint folder inside checkpoint_dir
DISTILLATION_VOCABULARIES = ("auto", "full", "text")


@dataclass
class FinetuneSettings:
    steps: int | None = option(
        None, "optimizer steps (default: as many as fit in --max-minutes; 0: no recovery)"
    )  # None: as many as fit in `max_minutes` (timed on the run's second step)
    batch_size: int = option(4, "sequences per optimizer step on each process", bounds="[1, inf)")
    learning_rate: float = option(2e-4, "peak learning rate (linear warm-up, cosine decay)", bounds="(0, inf)")
    warmup_steps: int = option(10, "steps of linear warm-up", bounds="[0, inf)")
    weight_decay: float = option(0.0, "AdamW weight decay", bounds="[0, inf)")
    temperature: float = option(1.0, "of distillation", bounds="(0, inf)")
    distill_weight: float = 1.0
    ce_weight: float = option(0.0, "next-token loss weight", bounds="[0, inf)")
    lora: bool = option(False, "LoRA adapters (merged at the end) instead of all weights")
    lora_rank: int = option(16, "rank of the LoRA adapters", bounds="[1, inf)")
    attention_only: bool = option(
        False, "train only the attention layers and gate tables (what the conversion changed)"
    )
    eval_every: int = option(100, "held-out perplexity every N steps (0: no)", bounds="[0, inf)")
    save_every: int = option(100, "checkpoint every N steps (0: at the end)", bounds="[0, inf)")
    checkpoint_dir: Path | None = None
    resume: bool = False
    seed: int = 0
    # A few minutes of recovery give most of what it gains (docs/results.md#behind-the-defaults).
    max_minutes: float | None = option(4.0, "stop after this long (and say so)", bounds="(0, inf)")
    gradient_accumulation_steps: int = option(1, "micro-batches per optimizer step on each process", bounds="[1, inf)")
    mixed_precision: str = option(
        "auto",
        "bf16: forward passes (student and teacher) under bfloat16 autocast, weights and optimizer in fp32; "
        "auto: bf16 where the device computes it natively (CUDA with bf16, a CPU with AVX512-BF16 or AMX) for "
        "models of width 512 or more",
        MIXED_PRECISIONS,
    )
    # The logits distilled. full: the whole vocabulary; text: only the tokens of the training text, both models'
    # distributions renormalised over them; auto: text where the output head has more weights than the layers (its
    # logits are then most of a step's products), the head is not trained, and the loss is distillation alone, else
    # full.
    distillation_vocabulary: str = "auto"

    def __post_init__(self) -> None:
        check_fields(self)
        if self.steps is None and self.max_minutes is None:
            raise ValueError("steps=None sizes the run to max_minutes: give max_minutes too.")
        if self.steps is not None and self.steps <= 0:
            raise ValueError(f"steps (--steps) must be positive, got {self.steps}.")
        if self.distill_weight <= 0 and self.ce_weight <= 0:
            raise ValueError("Nothing to train on: distill_weight and ce_weight are both 0.")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume=True needs a checkpoint_dir.")
        if self.attention_only and self.lora:
            raise ValueError("attention_only and lora are exclusive: LoRA already chooses what it trains.")
        if self.distillation_vocabulary not in DISTILLATION_VOCABULARIES:
            raise ValueError(
                f"distillation_vocabulary must be one of {DISTILLATION_VOCABULARIES}, got "
                f"{self.distillation_vocabulary!r}."
            )
        if self.distillation_vocabulary == "text" and self.ce_weight > 0:
            raise ValueError("distillation_vocabulary='text' renormalises the logits: it cannot go with ce_weight > 0.")

    @classmethod
    def from_scratch(cls, **overrides) -> "FinetuneSettings":
        """Next-token training of a fresh model for the given `steps`: cross-entropy only, no teacher, no time
        limit, in float32, no held-out evaluation unless `eval_every` is given."""
        preset = {
            "distill_weight": 0.0,
            "ce_weight": 1.0,
            "eval_every": 0,
            "max_minutes": None,
            "mixed_precision": "no",
        }
        return cls(**preset | overrides)


@dataclass
class FinetuneResult:
    model: EGMLAForCausalLM
    steps_done: int
    seconds: float
    history: list[dict] = field(default_factory=list)  # {"step", "loss"} and {"step", "held_out_loss"}
    stopped_early: bool = False
    steps_planned: int | None = None  # the schedule's length (budgeted when `steps` was None)
    distilled_tokens: int | None = None  # the vocabulary distilled over: its size (None: the whole vocabulary)


# Logits per chunk of the distillation loss (whole rows, at least one): on the CPU its fp32 temporaries stay within
# the caches; larger chunks were slower for every vocabulary measured (docs/results.md#behind-the-defaults). On an
# accelerator a chunk is a few kernel launches, so chunks are larger there, a few hundred MB of temporaries at most.
DISTILLATION_ELEMENTS_PER_CHUNK = 2**19
ACCELERATOR_ELEMENTS_PER_CHUNK = 2**25


class ChunkedDistillation(torch.autograd.Function):
    """KL(teacher || student) at temperature T, times T^2, averaged over tokens, computed a chunk of rows at a time;
    the gradient with respect to the student's logits, T (p_student - p_teacher) / tokens, is filled in on the way
    (all but its scale), so the backward pass only scales it."""

    @staticmethod
    def forward(ctx, student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
        student = student_logits.detach().reshape(-1, student_logits.shape[-1])  # [tokens, vocab]
        teacher = teacher_logits.detach().reshape(-1, teacher_logits.shape[-1])
        tokens, vocab = student.shape
        elements = DISTILLATION_ELEMENTS_PER_CHUNK if student.device.type == "cpu" else ACCELERATOR_ELEMENTS_PER_CHUNK
        rows_per_chunk = max(1, elements // vocab)
        gradient = torch.empty_like(student)
        total = torch.zeros((), dtype=torch.float64, device=student.device)
        for start in range(0, tokens, rows_per_chunk):
            rows = slice(start, start + rows_per_chunk)
            log_student = F.log_softmax(student[rows].float() / temperature, dim=-1)
            log_teacher = F.log_softmax(teacher[rows].float() / temperature, dim=-1)
            teacher_probs = log_teacher.exp()
            total += torch.vdot(teacher_probs.flatten(), log_teacher.sub_(log_student).flatten())
            gradient[rows] = log_student.exp_().sub_(teacher_probs)
        ctx.save_for_backward(gradient)
        ctx.scale = temperature / tokens
        ctx.logits_shape = student_logits.shape
        return (total * temperature**2 / tokens).to(torch.float32)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (gradient,) = ctx.saved_tensors
        return (gradient * (grad_output * ctx.scale).to(gradient.dtype)).view(ctx.logits_shape), None, None


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) per token at `temperature`, times T^2 (Hinton et al.) so gradients keep their scale;
    the teacher's logits take no gradient."""
    return ChunkedDistillation.apply(student_logits, teacher_logits, temperature)


def batch_indices(step: int, blocks: int, batch_size: int, seed: int, process: int = 0) -> torch.Tensor:
    """The rows of step `step` on process `process`: a function of (seed, step, process) only, so a resumed run
    sees the same batches and data-parallel processes see different ones."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + process)
    return torch.randint(0, blocks, (batch_size,), generator=generator)


def with_lora(model: EGMLAForCausalLM, settings: FinetuneSettings) -> PeftModel:
    config = LoraConfig(
        r=settings.lora_rank,
        lora_alpha=2 * settings.lora_rank,
        target_modules=[name for name in LORA_TARGET_MODULES if name != "gate_embedding_proj"],
        # The gate's up-projection starts at zero: a low-rank update of it would stay tiny, so train it in full,
        # and the gate tables too.
        modules_to_save=gate_table_names(model.config) + ["gate_embedding_proj"],
    )
    return get_peft_model(model, config)


def save_checkpoint(
    accelerator: Accelerator,
    folder: Path,
    step: int,
    history: list[dict],
    steps: int,
    finished: bool = False,
    vocabulary: dict | None = None,
) -> None:
    """accelerate state + progress, written beside the last checkpoint and swapped in by renames (on the main
    process; every process takes part in `save_state`). `finished`: the run ended there (its steps done, or stopped
    at its time limit), so a resumed run trains no further. `vocabulary`: `vocabulary_record` of the ids distilled
    over, so that a resume over other ids is refused."""
    staging = folder.with_name(folder.name + ".saving")
    previous = folder.with_name(folder.name + ".previous")
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging / STATE_FOLDER))
    if accelerator.is_main_process:
        (staging / PROGRESS_FILE).write_text(
            json.dumps(
                {"step": step, "history": history, "steps": steps, "finished": finished, "vocabulary": vocabulary}
            )
        )
        shutil.rmtree(previous, ignore_errors=True)
        if folder.exists():
            folder.rename(previous)
        staging.rename(folder)
        shutil.rmtree(previous, ignore_errors=True)
    accelerator.wait_for_everyone()


def vocabulary_record(vocabulary: torch.Tensor | None) -> dict | None:
    """What a checkpoint records of the token ids its loss was distilled over: their count and a digest (None: the
    whole vocabulary)."""
    if vocabulary is None:
        return None
    ids = vocabulary.detach().to("cpu", torch.int64).sort().values.numpy().tobytes()
    return {"tokens": len(vocabulary), "sha256": hashlib.sha256(ids).hexdigest()}


def resume_checkpoint(settings: "FinetuneSettings") -> Path | None:
    """The checkpoint a `resume=True` run continues from (None when not resuming); an error naming the folder when
    there is none, rather than a silent start from step 0."""
    if not settings.resume:
        return None
    found = saved_checkpoint(settings.checkpoint_dir)
    if found is None:
        raise ValueError(
            f"--resume: {settings.checkpoint_dir} holds no checkpoint to resume from; give the --checkpoint-dir the "
            "run saved into, or leave --resume out to start from step 0."
        )
    return found


def saved_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The checkpoint a run saved into `checkpoint_dir` (see `latest_checkpoint`); None when it saved none."""
    return latest_checkpoint(Path(checkpoint_dir) / LAST_CHECKPOINT)


def latest_checkpoint(folder: Path) -> Path | None:
    """`last`, or `last.previous` when a run died between the two renames of `save_checkpoint`."""
    for candidate in (folder, folder.with_name(folder.name + ".previous")):
        if (candidate / PROGRESS_FILE).exists():
            return candidate
    return None


@dataclass
class CosineSchedule:
    """The learning-rate factor: linear warm-up, then cosine decay to 0 at `steps` (known once budgeted). The
    warm-up is not shortened for short runs: capped at a tenth of a short recovery it left SmolLM2 further from its
    source (docs/results.md#behind-the-defaults)."""

    warmup_steps: int
    steps: int | None

    def __call__(self, step: int) -> float:
        warmup = min(1.0, (step + 1) / max(1, self.warmup_steps))
        total = self.steps or 1
        return warmup * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))


@dataclass
class Run:
    """What a training run holds once accelerate has prepared it."""

    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    schedule: CosineSchedule
    trainable: list[torch.nn.Parameter]
    autocast: torch.autocast  # the forward passes' (bfloat16 where `uses_bf16`, else disabled)
    vocabulary: torch.Tensor | None = None  # the token ids distilled over (`distillation_vocabulary`); None: all


def prepare_run(student: EGMLAForCausalLM, settings: FinetuneSettings) -> Run:
    """LoRA or the parameters to train, AdamW with warm-up and cosine decay, all prepared by accelerate."""
    # One scheduler step per optimizer step, however many processes (accelerate would step it once per process);
    # a student placed on the CPU beside an accelerator (`--device cpu`) trains there.
    on_cpu = student.device.type == "cpu" and torch.accelerator.is_available()
    accelerator = Accelerator(step_scheduler_with_optimizer=False, cpu=on_cpu)
    if accelerator.num_processes > 1 and getattr(student.config, "offload_gate_tables", False):
        raise ValueError(
            "offload_gate_tables trains in one process only (DDP and FSDP expect every parameter on the "
            "accelerator): load the student without it, or run one process with --gradient-accumulation-steps."
        )
    model = with_lora(student, settings) if settings.lora else student
    if settings.attention_only:
        for name, param in model.named_parameters():
            param.requires_grad_(".self_attn." in name or "gate_embeddings" in name)
    elif not settings.lora:  # every weight, whatever an earlier run left frozen
        model.requires_grad_(True)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.learning_rate, weight_decay=settings.weight_decay)

    schedule = CosineSchedule(settings.warmup_steps, settings.steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    autocast = fitting_autocast(settings.mixed_precision, accelerator.device, student.config.hidden_size)
    return Run(accelerator, model, optimizer, scheduler, schedule, trainable, autocast)


# The learning-rate schedule's length while the first two steps are timed: long enough that its cosine factor stays
# ~1 (their rates are the warm-up's); the third step's rate is set again once the length is known.
PROVISIONAL_STEPS = 1_000_000
# The share of a budget's time left after its first steps that its steps may fill: the schedule must end first.
BUDGET_SHARE = 0.92


def budgeted_start(run: Run, teacher, blocks: torch.Tensor, settings: FinetuneSettings, history: list[dict]) -> int:
    """Takes the run's first two steps and returns the optimizer steps that fit in `max_minutes`, from the second's
    time (the first pays for the allocator's warm-up): steps of the run, not passes thrown away. Most of what remains
    after them (BUDGET_SHARE), since the schedule must end before the time guard stops the run; the fewest of any process."""
    run.schedule.steps = PROVISIONAL_STEPS
    seconds = []
    for step in range(2):
        began = time.time()
        history.append({"step": step + 1, "loss": step_loss(run, teacher, blocks, settings, step)})
        seconds.append(max(time.time() - began, 1e-3))
    steps = 2 + max(0, int(BUDGET_SHARE * (settings.max_minutes * 60 - sum(seconds)) / seconds[1]))
    steps = int(run.accelerator.gather(torch.tensor([steps], device=run.accelerator.device)).min())
    run.schedule.steps = steps
    scheduler = getattr(run.scheduler, "scheduler", run.scheduler)  # accelerate's wrapper holds the LambdaLR
    for group, base in zip(run.optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = base * run.schedule(scheduler.last_epoch)  # it was set from the provisional length
    return steps


def head_logits(model: torch.nn.Module, hidden: torch.Tensor, vocabulary: torch.Tensor) -> torch.Tensor:
    """`model`'s output head on `hidden` over the token ids `vocabulary` only (soft-capped where its config says)."""
    head = model.get_output_embeddings()
    vocabulary = vocabulary.to(head.weight.device)
    bias = None if head.bias is None else head.bias[vocabulary]
    logits = F.linear(hidden, head.weight[vocabulary], bias)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def forward_logits(
    model: torch.nn.Module,
    unwrapped: torch.nn.Module,
    batch: torch.Tensor,
    vocabulary: torch.Tensor | None,
    labels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`model`'s logits on `batch` and its next-token loss on `labels` (None without): over the whole vocabulary, or
    over `vocabulary` from the last hidden states, the whole head then run on one position only (`unwrapped`, whose
    head is read, is `model` without accelerate's wrappers; a PEFT model forwards to its base model's head)."""
    if vocabulary is None:
        outputs = model(input_ids=batch, labels=labels, use_cache=False)
        return outputs.logits, outputs.loss
    outputs = model(input_ids=batch, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    return head_logits(unwrapped, outputs.hidden_states[-1], vocabulary), None


def distilled_vocabulary(
    student: EGMLAForCausalLM, teacher: torch.nn.Module | None, blocks: torch.Tensor, settings: FinetuneSettings
) -> torch.Tensor | None:
    """The token ids the distillation covers (`settings.distillation_vocabulary`): those of `blocks`, or None for
    the whole vocabulary."""
    choice = settings.distillation_vocabulary
    if choice == "auto":
        head = student.get_output_embeddings().weight.numel()
        layers = sum(parameter.numel() for parameter in student.model.layers.parameters())
        frozen_head = settings.attention_only or settings.lora  # a head trained over some tokens would drift on others
        choice = "text" if settings.ce_weight == 0 and frozen_head and head > layers else "full"
    if choice == "full" or teacher is None or settings.distill_weight <= 0:
        return None
    return torch.unique(blocks)


def step_loss(
    run: Run,
    teacher: torch.nn.Module | None,
    blocks: torch.Tensor,
    settings: FinetuneSettings,
    step: int,
    update: bool = True,
) -> float:
    """One optimizer step over `gradient_accumulation_steps` micro-batches (`update=False`: the passes only, the
    gradients dropped); the loss of the whole global batch."""
    accelerator, micro_batches = run.accelerator, settings.gradient_accumulation_steps
    student = accelerator.unwrap_model(run.model)  # whose head `forward_logits` reads
    total = torch.zeros((), device=accelerator.device)
    for micro in range(micro_batches):
        # Micro-batch j of process p draws the rows of "process" p * k + j: one process accumulating k
        # micro-batches sees exactly the samples of k data-parallel processes.
        source = accelerator.process_index * micro_batches + micro
        batch = blocks[batch_indices(step, len(blocks), settings.batch_size, settings.seed, source)]
        batch = batch.to(accelerator.device)
        with run.autocast:
            logits, next_token_loss = forward_logits(
                run.model, student, batch, run.vocabulary, batch if settings.ce_weight > 0 else None
            )
        loss = torch.zeros((), device=accelerator.device)
        if settings.distill_weight > 0:
            with torch.no_grad(), run.autocast:
                teacher_logits, _ = forward_logits(teacher, teacher, batch, run.vocabulary)
            loss = loss + settings.distill_weight * distillation_loss(logits, teacher_logits, settings.temperature)
        if settings.ce_weight > 0:
            loss = loss + settings.ce_weight * next_token_loss
        # Gradients are synchronized across processes on the last micro-batch only.
        sync = contextlib.nullcontext() if micro == micro_batches - 1 else accelerator.no_sync(run.model)
        with sync:
            accelerator.backward(loss / micro_batches)
        total = total + loss.detach() / micro_batches
    if update:
        accelerator.clip_grad_norm_(run.trainable, 1.0)
        run.optimizer.step()
        run.scheduler.step()
    run.optimizer.zero_grad()
    return accelerator.reduce(total, reduction="mean").item()


class Progress(NamedTuple):
    """Where a run resumes: the step to start at, the history so far, the run's total steps, whether it had ended."""

    step: int
    history: list[dict]
    steps: int | None
    finished: bool


def vocabulary_described(record: dict | None) -> str:
    return "the whole vocabulary" if record is None else f"{record['tokens']} token ids of its text"


def check_resumed_vocabulary(progress: dict, vocabulary: dict | None, checkpoint: Path) -> None:
    """A resumed run distils over the ids its checkpoint did (its loss would change mid-schedule otherwise); a
    checkpoint from before the record was kept is taken as it is."""
    if "vocabulary" not in progress or progress["vocabulary"] == vocabulary:
        return
    saved, asked = (vocabulary_described(record) for record in (progress["vocabulary"], vocabulary))
    raise ValueError(
        f"--resume: the checkpoint in {checkpoint} distilled over {saved}, this run over {asked}: resume with the "
        "same --train-text and distillation vocabulary, or start afresh without --resume."
    )


def resume_state(run: Run, settings: FinetuneSettings) -> Progress:
    """The progress of the last checkpoint when resuming (its state loaded into `run`), else a fresh start."""
    resume_from = resume_checkpoint(settings)
    if resume_from is None:
        return Progress(0, [], None, False)
    progress = json.loads((resume_from / PROGRESS_FILE).read_text())
    check_resumed_vocabulary(progress, vocabulary_record(run.vocabulary), resume_from)
    run.accelerator.load_state(str(resume_from / STATE_FOLDER))
    run.accelerator.print(f"resumed from {resume_from} at step {progress['step']}")
    return Progress(progress["step"], progress["history"], progress.get("steps"), progress.get("finished", False))


def finetune(
    student: EGMLAForCausalLM,
    teacher: torch.nn.Module | None,
    train_blocks: torch.Tensor | list[str],
    settings: FinetuneSettings,
    eval_blocks: torch.Tensor | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    block_size: int = 256,
) -> FinetuneResult:
    """Trains `student` on token blocks [N, S] (or documents, with their `tokenizer`) to match `teacher` (and/or
    the next tokens); returns the trained model (LoRA merged into it) and the loss history. Randomness comes from
    `settings.seed`; the caller's random state is left as it was."""
    if isinstance(train_blocks, list):
        if tokenizer is None:
            raise ValueError("Training on texts needs their tokenizer.")
        train_blocks = token_blocks(tokenizer, train_blocks, block_size)
    if teacher is None and settings.distill_weight > 0:
        raise ValueError("Distillation (distill_weight > 0) needs a teacher.")
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        torch.manual_seed(settings.seed)
        student.zero_grad(set_to_none=True)  # gradients a caller left would add to the first step's
        vocabulary = distilled_vocabulary(student, teacher, train_blocks, settings)
        run = prepare_run(student, settings)
        if vocabulary is not None:
            run.vocabulary = vocabulary.to(run.accelerator.device)
        return train_loop(run, teacher, train_blocks, settings, eval_blocks)


def scheduled(run: Run, teacher, train_blocks: torch.Tensor, settings: FinetuneSettings) -> tuple:
    """(the settings with the schedule's length, the step to start from, the history so far): a resumed run keeps the
    schedule it started with; a run without `steps` takes what fits in its minutes, timed on its first two steps."""
    start_step, history, saved_steps, finished = resume_state(run, settings)
    if finished and settings.steps in (None, saved_steps):
        # The run had ended (a kill came after its last checkpoint) and no longer run is asked for: train no further.
        return dataclasses.replace(settings, steps=start_step), start_step, history
    if settings.steps is not None:
        return settings, start_step, history
    steps = saved_steps
    if not steps and start_step:
        raise ValueError(
            f"The checkpoint in {Path(settings.checkpoint_dir) / LAST_CHECKPOINT} (step {start_step}) does not say how "
            "long its schedule was: resume it with --steps N (the run's total)."
        )
    if not steps:
        steps, start_step = budgeted_start(run, teacher, train_blocks, settings, history), 2
    run.schedule.steps = steps
    run.accelerator.print(f"fine-tuning for {steps} steps (what fits in {settings.max_minutes} minutes)")
    return dataclasses.replace(settings, steps=steps), start_step, history


def train_loop(
    run: Run,
    teacher: torch.nn.Module | None,
    train_blocks: torch.Tensor,
    settings: FinetuneSettings,
    eval_blocks: torch.Tensor | None,
) -> FinetuneResult:
    accelerator = run.accelerator
    if teacher is not None:
        teacher = teacher.to(accelerator.device).eval()
    checkpoint = Path(settings.checkpoint_dir) / LAST_CHECKPOINT if settings.checkpoint_dir else None
    record = vocabulary_record(run.vocabulary)
    started = time.time()
    settings, start_step, history = scheduled(run, teacher, train_blocks, settings)
    stopped_early = False
    bar = tqdm(
        range(start_step, settings.steps),
        desc="fine-tuning",
        unit="step",
        initial=start_step,
        total=settings.steps,
        disable=not accelerator.is_local_main_process,
    )
    step = start_step
    for step in bar:
        loss = step_loss(run, teacher, train_blocks, settings, step)
        history.append({"step": step + 1, "loss": loss})
        bar.set_postfix(loss=f"{loss:.4f}")
        done = step + 1
        if eval_blocks is not None and settings.eval_every and done % settings.eval_every == 0:
            held_out, accuracy = loss_and_accuracy(run.model, eval_blocks, settings.batch_size)
            history.append({"step": done, "held_out_loss": held_out, "held_out_accuracy": accuracy})
            accelerator.print(f"step {done}: held-out perplexity {math.exp(held_out):.3f}")
        if checkpoint is not None and settings.save_every and done % settings.save_every == 0:
            save_checkpoint(accelerator, checkpoint, done, history, settings.steps, vocabulary=record)
        if settings.max_minutes is not None and time.time() - started > settings.max_minutes * 60:
            stopped_early = done < settings.steps
            break
    steps_done = step + 1 if settings.steps > start_step else start_step
    if checkpoint is not None:
        save_checkpoint(accelerator, checkpoint, steps_done, history, settings.steps, finished=True, vocabulary=record)
    # Without the autocast wrapper of a mixed precision configured through `accelerate launch`.
    model = accelerator.unwrap_model(run.model, keep_fp32_wrapper=False)
    if isinstance(model, PeftModel):
        model = model.merge_and_unload()
    model.eval()
    distilled = None if run.vocabulary is None else len(run.vocabulary)
    return FinetuneResult(model, steps_done, time.time() - started, history, stopped_early, settings.steps, distilled)


def settings_summary(settings: FinetuneSettings) -> dict:
    summary = asdict(settings)
    summary["checkpoint_dir"] = str(settings.checkpoint_dir) if settings.checkpoint_dir else None
    return summary
