"""Panel (d): decode ms per token on the CPU, each model on its default path (a dynamic cache, no
`attn_implementation` argument: what a user gets) and compiled over a static cache (`torch.compile` of the whole
forward), medians over interleaved repetitions in one process, as ratios to Llama MHA; plus the tokens/s each reaches
when a fixed cache budget sets how many sequences decode together.

The caches are filled with random contents of the context's length (and random token ids for the gate), not by a
prefill: a decode step costs the same whatever the cache holds, and a 12-layer prefill of 8 sequences of 4096 tokens would take
minutes per model on two cores.
"""

import torch

from ..measure import cache_bytes_per_token, decode_state, median_ms
from .models import LABELS, build, paper_dims

# (column, model, cache): every model on its default path, and compiled over a static cache.
VARIANTS = (
    ("mha", "mha", "dynamic"),
    ("mha-static", "mha", "static"),
    ("deepseek-v3-mla", "deepseek-v3-mla", "dynamic"),
    ("mla-base", "mla-base", "dynamic"),
    ("mla-base-static", "mla-base", "static"),
    ("egmla-kv64", "egmla-kv64", "dynamic"),
    ("egmla-kv64-static", "egmla-kv64", "static"),
    ("egmla-kv64-latent", "egmla-kv64-latent", "dynamic"),
    ("egmla-kv64-latent-static", "egmla-kv64-latent", "static"),
)
BUDGET_MODELS = ("mha", "deepseek-v3-mla", "mla-base", "egmla-kv64", "egmla-kv64-latent")


def column_label(column: str) -> str:
    if column.endswith("-static"):
        return LABELS[column.removesuffix("-static")] + ", compiled static"
    return LABELS[column]


@torch.no_grad()
def run_decode(
    quick: bool = False,
    contexts: tuple[int, ...] = (512, 2048, 4096),
    batches: tuple[int, ...] = (1, 8),
    repetitions: int = 5,
    steps: int = 2,
    budget_mib: float = 64,
    budget_context: int = 512,
) -> dict:
    if quick:
        # One cell: each compiled static variant compiles its graphs afresh for every batch size.
        dims, contexts, batches, repetitions, steps = paper_dims(layers=1, vocab_size=512), (32,), (2,), 2, 1
        budget_mib, budget_context = 0.1, 32
    else:
        dims = paper_dims()
    max_positions = max(*contexts, budget_context) + 16
    models = {name: build(name, dims, max_positions) for name in {model for _, model, _ in VARIANTS}}
    grid = []
    for batch_size in batches:
        for context in contexts:
            torch._dynamo.reset()  # each cell compiles its own static shapes; the earlier graphs are not needed
            states = {
                column: decode_state(models[model], cache_kind, batch_size, context)
                for column, model, cache_kind in VARIANTS
            }
            ms = median_ms(states, repetitions, steps)
            del states  # the next cell's caches are built before this dict would be replaced
            grid.append({"batch": batch_size, "context": context, "ms_per_token": ms})
            print(f"batch {batch_size}, context {context}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()))

    # A fixed cache budget: as many sequences as their caches fit, all decoding together (default paths).
    probe = torch.randint(0, dims["vocab_size"] - 1, (1, 8))
    bytes_per_token = {name: cache_bytes_per_token(models[name], probe, new_tokens=4) for name in BUDGET_MODELS}
    budget_bytes = budget_mib * 2**20
    sequences = {name: max(1, int(budget_bytes // (value * budget_context))) for name, value in bytes_per_token.items()}
    budget_ms = {}
    for name in BUDGET_MODELS:
        state = decode_state(models[name], "dynamic", sequences[name], budget_context)
        budget_ms[name] = median_ms({name: state}, max(1, repetitions // 2), steps)[name]
    throughput = {
        name: {
            "cache_bytes_per_token": bytes_per_token[name],
            "sequences": sequences[name],
            "ms_per_step": budget_ms[name],
            "tokens_per_s": sequences[name] * 1000 / budget_ms[name],
        }
        for name in BUDGET_MODELS
    }
    return {
        "layers": dims["num_hidden_layers"],
        "threads": torch.get_num_threads(),
        "repetitions": repetitions,
        "steps": steps,
        "cache_bytes_per_token": {column: bytes_per_token.get(model) for column, model, _ in VARIANTS},
        "grid": grid,
        "budget": {"mib": budget_mib, "context": budget_context, "models": throughput},
    }


def ratio_grid(grid: list[dict], key: str, baseline: str, label=str) -> list[str]:
    """Markdown rows of (batch, context) cells: each column's ms and its ratio to the `baseline` column's."""
    columns = list(grid[0][key])
    lines = ["| batch | context | " + " | ".join(label(column) for column in columns) + " |"]
    lines.append("|---|---|" + "---|" * len(columns))
    for row in grid:
        ms = row[key]
        cells = [f"{ms[column]:.1f} ({ms[column] / ms[baseline]:.2f}x)" for column in columns]
        lines.append(f"| {row['batch']} | {row['context']} | " + " | ".join(cells) + " |")
    return lines


def decode_table(result: dict) -> list[str]:
    """The grid as markdown rows: ms/token and the ratio to MHA's default path in each cell."""
    columns = list(result["grid"][0]["ms_per_token"])
    lines = ratio_grid(result["grid"], "ms_per_token", "mha", column_label)
    bytes_row = [f"{result['cache_bytes_per_token'][column] or 0:,.0f}" for column in columns]
    lines.append("| cache bytes/token | | " + " | ".join(bytes_row) + " |")
    return lines


def print_decode(result: dict) -> None:
    print(
        f"\ndecode ms/token on the CPU ({result['layers']} layers, {result['threads']} threads, medians of "
        f"{result['repetitions']} interleaved repetitions x {result['steps']} steps), ratio to MHA (Llama)"
    )
    print("\n".join(decode_table(result)))
    budget = result["budget"]
    print(f"\nwith a {budget['mib']:g} MiB cache budget at context {budget['context']}:")
    print("| model | cache bytes/token | sequences | ms/step | tokens/s |\n|---|---|---|---|---|")
    for name, row in budget["models"].items():
        print(
            f"| {LABELS[name]} | {row['cache_bytes_per_token']:,.0f} | {row['sequences']} | {row['ms_per_step']:.1f} "
            f"| {row['tokens_per_s']:.1f} |"
        )
