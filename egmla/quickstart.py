"""`egmla quickstart`, the two-minute alternative to the main job: train a small EG-MLA from scratch and show its
cache.

Steps: tokenize TinyStories text (embedded excerpt by default), hold out the last stories, train an EG-MLA
model with accelerate, report held-out perplexity before and after, generate a sample, measure the bytes held by
real caches after `generate` (EG-MLA vs the MLA and Llama-MHA models of the same width), and save a Hub-ready
folder that reloads with `trust_remote_code=True`.
"""

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from .configuration_egmla import EGMLAConfig
from .data import EXCERPT, TOKENIZER
from .hub import TINYSTORIES, SourceMetadata, perplexity_result, save_card, text_dataset
from .measure import cache_bytes_per_token
from .modeling_egmla import EGMLAForCausalLM
from .options import check_fields, option
from .outputs import atomic_folder, check_output_folder, report_json
from .text import mean_loss, read_documents, split_documents, token_blocks
from .training import FinetuneSettings, finetune


@dataclass
class QuickstartSettings:
    out: Path = option(Path("runs/quickstart"), "output folder")
    train_text: Path = option(EXCERPT, "<|endoftext|>-separated", input_file=True)
    tokenizer: Path = option(TOKENIZER, "tokenizer folder")
    steps: int = option(500, "optimizer steps", bounds="[1, inf)")
    batch_size: int = option(16, "blocks per step", bounds="[1, inf)")
    block_size: int = option(128, "tokens per block", bounds="[2, inf)")
    learning_rate: float = option(3e-3, "peak learning rate", bounds="(0, inf)")
    held_out_fraction: float = 0.1
    kv_lora_rank: int = option(16, "latent width", bounds="[1, inf)")
    gate_embedding_dim: int = option(
        64, "width of the gate tables; 0 = plain MLA", bounds="[0, inf)"
    )
    seed: int = option(0, "of the weights, the gate tables and the batches")
    overwrite: bool = option(False, "replace --out if it exists")
    # None is written unless given: the model is trained here.
    license: str | None = option(None, "the card's licence, a Hub licence id such as apache-2.0 (default: none)")

    def __post_init__(self) -> None:
        check_fields(self)


def small_config(tokenizer: PreTrainedTokenizerBase, **overrides) -> EGMLAConfig:
    """A 4-layer, width-128 model that trains in a minute or two on 2 CPU cores."""
    values = {
        "vocab_size": len(tokenizer),
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "max_position_embeddings": 512,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": True,
    }
    values.update(overrides)
    return EGMLAConfig(**values)


def train(model: EGMLAForCausalLM, blocks: torch.Tensor, settings: QuickstartSettings) -> list[float]:
    """Next-token training from scratch: the recovery fine-tuning loop with cross-entropy only."""
    training = FinetuneSettings.from_scratch(
        steps=settings.steps,
        batch_size=settings.batch_size,
        learning_rate=settings.learning_rate,
        warmup_steps=20,
        seed=settings.seed,
    )
    result = finetune(model, None, blocks, training)
    return [entry["loss"] for entry in result.history]


def cache_comparison(
    model: EGMLAForCausalLM, tokenizer: PreTrainedTokenizerBase, prompt: torch.Tensor, settings: QuickstartSettings
) -> dict[str, float]:
    """Cache bytes per token after `generate`: this model against MLA of the same width (gate off, a latent four times
    wider) and a Llama with full multi-head K/V."""
    config = model.config
    torch.manual_seed(settings.seed)
    mla = EGMLAForCausalLM(small_config(tokenizer, kv_lora_rank=4 * settings.kv_lora_rank, gate_embedding_dim=0)).eval()
    mha = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
        )
    ).eval()
    models = (("llama_mha", mha), ("mla", mla), ("egmla", model))
    return {name: cache_bytes_per_token(m, prompt, new_tokens=16) for name, m in models}


def run_quickstart(settings: QuickstartSettings) -> dict:
    out = check_output_folder(settings.out, settings.overwrite)
    random.seed(settings.seed)
    torch.manual_seed(settings.seed)
    started = time.time()

    tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer)
    stories = read_documents(settings.train_text)
    train_stories, held_out_stories = split_documents(stories, settings.held_out_fraction)
    train_blocks = token_blocks(tokenizer, train_stories, settings.block_size)
    held_out_blocks = token_blocks(tokenizer, held_out_stories, settings.block_size)
    print(
        f"text: {len(stories)} stories -> {train_blocks.numel():,} training tokens, "
        f"{held_out_blocks.numel():,} held-out tokens (the last {len(held_out_stories)} stories)"
    )

    config = small_config(tokenizer, kv_lora_rank=settings.kv_lora_rank, gate_embedding_dim=settings.gate_embedding_dim)
    model = EGMLAForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"EG-MLA: {parameters:,} parameters, kv_lora_rank {config.kv_lora_rank}, "
        f"gate_embedding_dim {config.gate_embedding_dim}, gate on the {config.gate_position}"
    )

    loss_before = mean_loss(model, held_out_blocks, settings.batch_size)
    losses = train(model, train_blocks, settings)
    model = model.cpu().eval()
    loss_after = mean_loss(model, held_out_blocks, settings.batch_size)

    prompt = tokenizer("Once upon a time", return_tensors="pt")
    sample_ids = model.generate(**prompt, max_new_tokens=48, do_sample=False)
    sample = tokenizer.decode(sample_ids[0], skip_special_tokens=True)

    cache = cache_comparison(model, tokenizer, held_out_blocks[:4, :32], settings)

    report = {
        "parameters": parameters,
        "steps": settings.steps,
        "train_loss_first": losses[0],
        "train_loss_last": sum(losses[-20:]) / len(losses[-20:]),
        "held_out_loss_before": loss_before,
        "held_out_loss_after": loss_after,
        "held_out_perplexity_after": math.exp(loss_after),
        "cache_bytes_per_token": cache,
        "sample": sample,
    }

    with atomic_folder(out, settings.overwrite) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "quickstart_report.json").write_text(report_json(report))
        write_card(staging, out.name, report, settings)

    reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    report["reload_generates_the_same"] = bool(
        torch.equal(reloaded.generate(**prompt, max_new_tokens=48, do_sample=False), sample_ids)
    )
    report["seconds"] = round(time.time() - started, 1)
    print_report(report, out)
    return report


def write_card(folder: Path, model_name: str, report: dict, settings: QuickstartSettings) -> None:
    """README.md: a Hub model card made by huggingface_hub (no base model: trained from scratch here)."""
    dataset = text_dataset(settings.train_text)
    cache = report["cache_bytes_per_token"]
    body = f"""
# EG-MLA trained from scratch by `egmla quickstart`

A {report["parameters"]:,}-parameter Embedding-Gated Multi-head Latent Attention model (arXiv 2509.16686) trained
by [egmla](https://pypi.org/project/egmla/) for {report["steps"]} steps on `{dataset[1]}`, the last
{settings.held_out_fraction:.0%} of its documents held out.

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("<this folder or repo>", trust_remote_code=True)
```

| what | value |
|---|---|
| held-out loss, untrained -> trained | {report["held_out_loss_before"]:.3f} -> {report["held_out_loss_after"]:.3f} |
| held-out perplexity | {report["held_out_perplexity_after"]:.2f} |
| cache bytes per token (all layers, fp32): Llama MHA / MLA / EG-MLA | {cache["llama_mha"]:.0f} / {cache["mla"]:.0f} / \
{cache["egmla"]:.0f} |

The rest of the measurements are in `quickstart_report.json`.
"""
    save_card(
        folder,
        body,
        model_name,
        SourceMetadata(license=settings.license),
        [perplexity_result(report["held_out_perplexity_after"], dataset)],
        tags=["from-scratch"],
        datasets=[TINYSTORIES] if dataset[0] == TINYSTORIES else None,
    )


def print_report(report: dict, out: Path) -> None:
    cache = report["cache_bytes_per_token"]
    print()
    print(
        f"held-out loss: {report['held_out_loss_before']:.3f} (untrained) -> {report['held_out_loss_after']:.3f} "
        f"after {report['steps']} steps (perplexity {report['held_out_perplexity_after']:.2f})"
    )
    print("cache bytes per token, all layers, fp32, measured on the cache objects after generate:")
    for name, label in (
        ("llama_mha", "Llama MHA (same width)"),
        ("mla", "MLA (gate off, 4x latent)"),
        ("egmla", "EG-MLA (this model)"),
    ):
        print(f"  {label:28s} {cache[name]:8.1f}   x{cache[name] / cache['egmla']:.2f} of EG-MLA")
    print(f"sample: {report['sample']!r}")
    print(
        f"saved a Hub-ready folder (weights, tokenizer, remote code) to {out}; "
        f"trust_remote_code reload generates the same: {report['reload_generates_the_same']}"
    )
    print(f"done in {report['seconds']} s")
