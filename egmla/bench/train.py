"""Panels (a) and (b): from-scratch training at a size this machine runs. MLA with a large latent against EG-MLA
with a small latent and several gate-embedding widths, the same token budget each; held-out loss and next-token
accuracy along the way. Every run checkpoints and resumes, and its result is cached as JSON."""

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ..configuration_egmla import EGMLAConfig
from ..data import EXCERPT, TOKENIZER
from ..modeling_egmla import EGMLAForCausalLM
from ..text import loss_and_accuracy, read_documents, split_documents, token_blocks
from ..training import FinetuneSettings, finetune, saved_checkpoint

SHARED_TEXT = Path("../shared/assets/text/tinystories_train_2MiB.txt")


@dataclass
class TrainBench:
    """One grid of runs (six by default, 250 steps of 16 sequences of 256 tokens each, about 30 minutes on 2 CPU cores)."""

    train_text: Path = SHARED_TEXT
    tokenizer: Path = TOKENIZER
    hidden_size: int = 256
    layers: int = 4
    heads: int = 4
    mla_kv_lora_rank: int = 128
    egmla_kv_lora_rank: int = 32
    gate_dims: tuple[int, ...] = (0, 32, 64, 128, 256)
    steps: int = 250
    batch_size: int = 16
    block_size: int = 256
    learning_rate: float = 3e-3
    eval_every: int = 50
    eval_blocks: int = 32
    max_minutes_per_run: float = 10.0  # a guard only: every run is meant to finish its steps
    seed: int = 0


QUICK = TrainBench(
    train_text=EXCERPT, hidden_size=64, layers=2, mla_kv_lora_rank=32, egmla_kv_lora_rank=8, gate_dims=(0, 16),
    steps=4, batch_size=4, block_size=64, eval_every=2, eval_blocks=4,
)  # fmt: skip


def variants(bench: TrainBench) -> dict[str, dict]:
    """name -> (kv_lora_rank, gate_embedding_dim): MLA first, then EG-MLA by gate width."""
    runs = {f"mla-r{bench.mla_kv_lora_rank}": {"kv_lora_rank": bench.mla_kv_lora_rank, "gate_embedding_dim": 0}}
    for gate_dim in bench.gate_dims:
        runs[f"egmla-r{bench.egmla_kv_lora_rank}-g{gate_dim}"] = {
            "kv_lora_rank": bench.egmla_kv_lora_rank,
            "gate_embedding_dim": gate_dim,
        }
    return runs


def model_config(bench: TrainBench, tokenizer, kv_lora_rank: int, gate_embedding_dim: int) -> EGMLAConfig:
    head_dim = bench.hidden_size // bench.heads
    return EGMLAConfig(
        vocab_size=len(tokenizer),
        hidden_size=bench.hidden_size,
        intermediate_size=3 * bench.hidden_size,
        num_hidden_layers=bench.layers,
        num_attention_heads=bench.heads,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=head_dim // 2,
        qk_rope_head_dim=head_dim // 2,
        v_head_dim=head_dim,
        gate_embedding_dim=gate_embedding_dim,
        max_position_embeddings=2 * bench.block_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )


def train_variant(bench: TrainBench, name: str, dims: dict, tokenizer, blocks: tuple, folder: Path) -> dict:
    """One variant trained from scratch (resuming its checkpoints) and scored on the held-out blocks."""
    train_blocks, held_out = blocks
    torch.manual_seed(bench.seed)
    config = model_config(bench, tokenizer, **dims)
    model = EGMLAForCausalLM(config)
    started = time.time()
    training = FinetuneSettings.from_scratch(
        steps=bench.steps,
        batch_size=bench.batch_size,
        learning_rate=bench.learning_rate,
        warmup_steps=max(1, bench.steps // 20),
        eval_every=bench.eval_every,
        save_every=bench.eval_every,
        checkpoint_dir=folder / "checkpoints" / name,
        resume=saved_checkpoint(folder / "checkpoints" / name) is not None,
        seed=bench.seed,
        max_minutes=bench.max_minutes_per_run,
    )
    result = finetune(model, None, train_blocks, training, eval_blocks=held_out)
    loss, accuracy = loss_and_accuracy(result.model, held_out, bench.batch_size)
    tokens_per_step = bench.batch_size * bench.block_size
    curve = [
        {"tokens": entry["step"] * tokens_per_step, "loss": entry["held_out_loss"], "accuracy": entry["held_out_accuracy"]}
        for entry in result.history
        if "held_out_loss" in entry
    ]  # fmt: skip
    print(f"{name}: held-out loss {loss:.4f}, accuracy {accuracy:.4f} after {result.steps_done} steps")
    return {
        "bench": bench_description(bench),
        **dims,
        "kv_values_per_token_per_layer": config.kv_cache_values_per_token() // config.num_hidden_layers,
        "gate_table_parameters": config.num_gate_tables * config.vocab_size * config.gate_embedding_dim,
        "parameters": sum(p.numel() for p in result.model.parameters()),
        "steps_done": result.steps_done,
        "tokens": result.steps_done * tokens_per_step,
        "held_out_loss": loss,
        "held_out_perplexity": math.exp(loss),
        "held_out_accuracy": accuracy,
        "curve": curve,
        "seconds": round(time.time() - started, 1),
    }


def bench_description(bench: TrainBench) -> dict:
    """The bench's settings as its JSON holds them: a cached run is reused only under the same ones."""
    return json.loads(json.dumps(asdict(bench), default=str))


def run_train(bench: TrainBench, results: Path) -> dict:
    """Trains every variant not already cached under `results/train/` (interrupted runs resume)."""
    if not Path(bench.train_text).is_file():
        raise FileNotFoundError(
            f"Training text {bench.train_text} not found: pass --train-text FILE (TinyStories-like documents)."
        )
    tokenizer = AutoTokenizer.from_pretrained(bench.tokenizer)
    train_documents, held_out_documents = split_documents(read_documents(bench.train_text), 0.1)
    train_blocks = token_blocks(tokenizer, train_documents, bench.block_size)
    held_out = token_blocks(tokenizer, held_out_documents, bench.block_size)[: bench.eval_blocks]
    folder = results / "train"
    folder.mkdir(parents=True, exist_ok=True)
    runs = {}
    for name, dims in variants(bench).items():
        cached = folder / f"{name}.json"
        if cached.is_file() and json.loads(cached.read_text())["bench"] == bench_description(bench):
            runs[name] = json.loads(cached.read_text())
            print(f"{name}: cached in {cached}")
            continue
        runs[name] = train_variant(bench, name, dims, tokenizer, (train_blocks, held_out), folder)
        cached.write_text(json.dumps(runs[name], indent=2) + "\n")
    return {
        "train_text": str(bench.train_text),
        "train_tokens_available": train_blocks.numel(),
        "held_out_tokens": held_out.numel(),
        "runs": runs,
    }


def print_train(result: dict) -> None:
    print(f"\nfrom-scratch training on {result['train_text']} ({result['held_out_tokens']:,} held-out tokens)")
    print(
        "| run | latent | gate width | gate-table params | KV values/token/layer | tokens | held-out loss "
        "| held-out accuracy |\n|---|---|---|---|---|---|---|---|"
    )
    for name, run in result["runs"].items():
        print(
            f"| {name} | {run['kv_lora_rank']} | {run['gate_embedding_dim']} | {run['gate_table_parameters']:,} "
            f"| {run['kv_values_per_token_per_layer']} | {run['tokens']:,} | {run['held_out_loss']:.4f} "
            f"| {run['held_out_accuracy']:.4f} |"
        )
