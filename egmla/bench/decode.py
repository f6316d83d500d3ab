"""Panel (d): decode ms per token on the CPU, MLA-Base vs EG-MLA-kv64 (the same code, gate off / on, both through
`egmla_fused`), the Llama MHA of the same width and transformers' DeepSeek-V3 MLA, medians over interleaved
repetitions in one process; plus the tokens/s each reaches when a fixed cache budget sets how many sequences
decode together."""

import statistics
import time

import torch

from ..measure import cache_bytes_per_token
from .models import LABELS, build, paper_dims

DECODE_MODELS = ("mla-base", "egmla-kv64", "mha", "deepseek-v3-mla")


class DecodeState:
    """A model with a prefilled cache of `context` tokens for `batch_size` sequences; `step()` decodes one token and
    crops the cache back, so every timed step sees the same context."""

    def __init__(self, model: torch.nn.Module, batch_size: int, context: int, vocab_size: int):
        self.model = model
        generator = torch.Generator().manual_seed(context + batch_size)
        prompt = torch.randint(0, vocab_size - 1, (batch_size, context), generator=generator)
        self.token = torch.randint(0, vocab_size - 1, (batch_size, 1), generator=generator)
        self.cache = model(prompt, use_cache=True).cache

    def step(self) -> None:
        self.model(self.token, cache=self.cache, use_cache=True)
        self.cache.crop(-1)


def median_ms(states: dict[str, DecodeState], repetitions: int, steps: int) -> dict[str, float]:
    """Interleaved: every repetition times each model in turn (the machine is shared and noisy)."""
    for state in states.values():
        state.step()  # warm-up: compiles the fused path, first allocations
    samples = {name: [] for name in states}
    for _ in range(repetitions):
        for name, state in states.items():
            started = time.perf_counter()
            for _ in range(steps):
                state.step()
            samples[name].append((time.perf_counter() - started) * 1000 / steps)
    return {name: statistics.median(values) for name, values in samples.items()}


@torch.no_grad()
def run_decode(
    quick: bool = False,
    contexts: tuple[int, ...] = (512, 2048),
    batches: tuple[int, ...] = (1, 8),
    repetitions: int = 5,
    steps: int = 2,
    budget_mib: float = 64,
    budget_context: int = 512,
) -> dict:
    if quick:
        dims, contexts, batches, repetitions, steps = paper_dims(layers=1, vocab_size=512), (32,), (1, 2), 2, 1
        budget_mib, budget_context = 0.1, 32
    else:
        dims = paper_dims()
    max_positions = max(*contexts, budget_context) + 8
    models = {name: build(name, dims, max_positions) for name in DECODE_MODELS}
    for name in ("mla-base", "egmla-kv64"):
        models[name].set_attn_implementation("egmla_fused")
    grid = []
    for batch_size in batches:
        for context in contexts:
            states = {
                name: DecodeState(model, batch_size, context, dims["vocab_size"]) for name, model in models.items()
            }
            ms = median_ms(states, repetitions, steps)
            grid.append({"batch": batch_size, "context": context, "ms_per_token": ms})
            print(
                f"batch {batch_size}, context {context}: "
                + ", ".join(f"{LABELS[name]} {value:.1f} ms" for name, value in ms.items())
            )

    # A fixed cache budget: as many sequences as their caches fit, all decoding together.
    probe = torch.randint(0, dims["vocab_size"] - 1, (1, 8))
    bytes_per_token = {name: cache_bytes_per_token(model, probe, new_tokens=4) for name, model in models.items()}
    budget_bytes = budget_mib * 2**20
    sequences = {name: max(1, int(budget_bytes // (value * budget_context))) for name, value in bytes_per_token.items()}
    budget_ms = {}
    for name, model in models.items():
        state = DecodeState(model, sequences[name], budget_context, dims["vocab_size"])
        budget_ms[name] = median_ms({name: state}, max(1, repetitions // 2), steps)[name]
    throughput = {
        name: {
            "cache_bytes_per_token": bytes_per_token[name],
            "sequences": sequences[name],
            "ms_per_step": budget_ms[name],
            "tokens_per_s": sequences[name] * 1000 / budget_ms[name],
        }
        for name in models
    }
    return {
        "layers": dims["num_hidden_layers"],
        "threads": torch.get_num_threads(),
        "repetitions": repetitions,
        "steps": steps,
        "grid": grid,
        "budget": {"mib": budget_mib, "context": budget_context, "models": throughput},
    }


def print_decode(result: dict) -> None:
    names = list(result["grid"][0]["ms_per_token"])
    print(
        f"\ndecode ms/token on the CPU ({result['layers']} layers, {result['threads']} threads, medians of "
        f"{result['repetitions']} interleaved repetitions x {result['steps']} steps), ratio to MLA-Base"
    )
    print("| batch | context | " + " | ".join(LABELS[name] for name in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for row in result["grid"]:
        mla = row["ms_per_token"]["mla-base"]
        cells = [f"{row['ms_per_token'][name]:.1f} ({row['ms_per_token'][name] / mla:.2f}x)" for name in names]
        print(f"| {row['batch']} | {row['context']} | " + " | ".join(cells) + " |")
    budget = result["budget"]
    print(f"\nwith a {budget['mib']:g} MiB cache budget at context {budget['context']}:")
    print("| model | cache bytes/token | sequences | ms/step | tokens/s |\n|---|---|---|---|---|")
    for name, row in budget["models"].items():
        print(
            f"| {LABELS[name]} | {row['cache_bytes_per_token']:,.0f} | {row['sequences']} | {row['ms_per_step']:.1f} "
            f"| {row['tokens_per_s']:.1f} |"
        )
