"""`egmla bench converted SRC OUT [OUT ...]`: a user's conversion against its own source at decode.

For each cell (batch, context), every model continues the same real text: its cache is filled by a prefill of that
text (so a gate on K/V meets the text's repeated tokens, not a worst case), then one greedy step is timed on its
default path (a dynamic cache, what `generate` uses) and compiled over a static cache (`torch.compile` of the whole
forward, one graph per cell), interleaved over repetitions in one process (the machine is shared and noisy) after a
warm-up. Ratios are to the source's default path in the same cell. Then a fixed cache budget, the source's cache
at the largest batch and its shortest context measured (by default (8, 2048)): as many sequences as each model's
cache fits there decode together, and its tokens/s is reported.
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from ..conversion.source import load_llama, load_tokenizer
from ..data import EXCERPT
from ..measure import DecodeState, median_ms
from ..modeling_egmla import cache_nbytes
from ..options import Placement
from ..text import read_documents, token_blocks
from .decode import ratio_grid

CELLS = ((1, 512), (1, 2048), (8, 2048), (8, 4096))
# Tokens per forward where a prefill continues a cache: their scores over the whole cache [B, H, chunk, T] stay small.
PREFILL_CHUNK = 512


@dataclass
class ConvertedBench:
    source: str  # the Llama the conversions came from: a folder, Hub id or GGUF file
    converted: list[str]  # converted folders
    cells: tuple[tuple[int, int], ...] = CELLS  # (batch, context), contexts capped at the source's
    text: Path = EXCERPT  # the contexts' text, cycled where it is shorter than a cell
    repetitions: int = 3
    steps: int = 2  # timed steps per repetition
    compiled: bool = True  # also time each model compiled over a static cache
    dtype: str = "float32"  # every model's weights and cache: float32 or bfloat16 (how CPU users serve)
    names: list[str] = field(default_factory=list)  # filled by `load_models`


def load_models(bench: ConvertedBench) -> dict[str, torch.nn.Module]:
    """The source and every converted folder (named by folder), all in the bench's dtype, on the CPU."""
    models = {"source": load_llama(bench.source, Placement(device="cpu", dtype=bench.dtype))}
    for folder in bench.converted:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, bench.dtype)).eval()
        models[Path(folder).name] = model
    bench.names = list(models)
    return models


def text_rows(bench: ConvertedBench, batch_size: int, context: int) -> torch.Tensor:
    """[batch, context + 1] token ids of the text, row after row (cycled when the text is short)."""
    blocks = token_blocks(load_tokenizer(bench.source), read_documents(bench.text), context + 1)
    return blocks.repeat(-(-batch_size // len(blocks)), 1)[:batch_size]


@torch.no_grad()
def prefilled(model: torch.nn.Module, rows: torch.Tensor, cache: DynamicCache | None = None) -> DynamicCache:
    """The model's own dynamic cache after a prefill of `rows` [B, T] (logits of the last position only); where
    `cache` already holds their first positions, the rest continues it, PREFILL_CHUNK tokens at a time. It records
    its past, so that a timed step's `crop(-1)` rolls back windowed layers as full ones."""
    cache = DynamicCache(config=model.config) if cache is None else cache
    cache.activate_past_recording()
    done = cache.get_seq_length()
    chunk = rows.shape[1] if done == 0 else PREFILL_CHUNK  # a prompt attends expanded, at once
    for start in range(done, rows.shape[1], chunk):
        model(rows[:, start : start + chunk], cache=cache, use_cache=True, logits_to_keep=1)
        cache.crop(0)  # windowed layers back to their window
    return cache


def static_copy(model: torch.nn.Module, dynamic: DynamicCache) -> StaticCache:
    """The same contents in a static cache with room for the timed steps (each step is cropped back)."""
    cache = StaticCache(config=model.config, max_cache_len=dynamic.get_seq_length() + 8)
    first = dynamic.layers[0]
    for name in ("token_ids", "positions"):  # kept once, on the first layer; written before the first update
        if getattr(first, name, None) is not None:
            cache.layers[0].append_per_token(name, getattr(first, name))
    for layer_idx, layer in enumerate(dynamic.layers):
        cache.update(layer.keys, layer.values, layer_idx)
    return cache


def states_for_cell(models: dict, caches: dict, bench: ConvertedBench, next_tokens: torch.Tensor) -> dict:
    """One DecodeState per model (and per compiled model), every cache holding the same context."""
    context = next(iter(caches.values())).get_seq_length()
    position = torch.full_like(next_tokens, context)
    states = {}
    for name, model in models.items():
        states[name] = DecodeState(model.forward, caches[name], next_tokens, position)
        if bench.compiled and not any(caches[name].is_sliding):  # a window's kept positions have no static copy
            compiled = torch.compile(model.forward, dynamic=False)
            states[f"{name}, compiled static"] = DecodeState(
                compiled, static_copy(model, caches[name]), next_tokens, position
            )
    return states


def cells_by_batch(bench: ConvertedBench, max_context: int) -> dict[int, list[int]]:
    """Contexts per batch, shortest first (one prefill per batch, continued), capped at the source's."""
    contexts: dict[int, set[int]] = {}
    for batch_size, context in bench.cells:
        contexts.setdefault(batch_size, set()).add(min(context, max_context))
    return {batch_size: sorted(values) for batch_size, values in contexts.items()}


def measure_cells(models: dict, bench: ConvertedBench) -> tuple[list[dict], dict]:
    """ms/step of every model (default and compiled static) in every cell; and the text of the largest batch at the
    shortest of its contexts, for the budget."""
    grid, budget = [], {}
    budget_batch = max(batch_size for batch_size, _ in bench.cells)
    max_context = models["source"].config.max_position_embeddings - 8
    for batch_size, contexts in cells_by_batch(bench, max_context).items():
        rows = text_rows(bench, batch_size, contexts[-1])
        caches = {name: DynamicCache(config=model.config) for name, model in models.items()}
        for context in contexts:
            for name, model in tqdm(models.items(), desc=f"prefill to {context}"):  # the text continued
                prefilled(model, rows[:, :context], caches[name])
            torch._dynamo.reset()  # each cell compiles its own static shapes
            states = states_for_cell(models, caches, bench, rows[:, context : context + 1])
            ms = median_ms(states, bench.repetitions, bench.steps)
            del states
            grid.append({"batch": batch_size, "context": context, "ms_per_step": ms})
            print(f"batch {batch_size}, context {context}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()))
        if batch_size == budget_batch:
            budget = {"batch": batch_size, "context": contexts[0], "rows": rows[:, : contexts[0] + 1]}
    return grid, budget


def measure_budget(models: dict, budget: dict, bench: ConvertedBench) -> dict:
    """The source's cache at (batch, context) as the budget: each model decodes as many sequences as fit in it (the
    prefilled rows repeated), on its default path; tokens/s."""
    batch_size, context, rows = budget["batch"], budget["context"], budget["rows"]
    caches = {name: prefilled(model, rows[:, :-1]) for name, model in models.items()}  # fresh: windows at their size
    per_token = {name: cache_nbytes(cache) / (batch_size * context) for name, cache in caches.items()}
    budget_bytes = per_token["source"] * batch_size * context
    results = {}
    for name, model in models.items():
        sequences = max(1, int(budget_bytes // (per_token[name] * context)))
        cache = caches.pop(name)  # let go once timed: each grows to about the budget
        repeats = -(-sequences // batch_size)
        cache.batch_repeat_interleave(repeats)
        cache.batch_select_indices(torch.arange(sequences))
        tokens = rows[:, -1:].repeat_interleave(repeats, dim=0)[:sequences]
        state = DecodeState(model.forward, cache, tokens, torch.full_like(tokens, context))
        ms = median_ms({name: state}, bench.repetitions, bench.steps)[name]
        results[name] = {"cache_bytes_per_token": per_token[name], "sequences": sequences, "ms_per_step": ms,
                         "tokens_per_s": sequences * 1000 / ms}  # fmt: skip
    return {"batch": batch_size, "context": context, "budget_bytes": budget_bytes, "models": results}


@torch.no_grad()
def run_converted(bench: ConvertedBench) -> dict:
    models = load_models(bench)
    grid, budget = measure_cells(models, bench)
    grid.sort(key=lambda row: (row["batch"], row["context"]))  # shown in order
    result = {"source": bench.source, "converted": bench.converted, "text": str(bench.text), "grid": grid,
              "threads": torch.get_num_threads(), "repetitions": bench.repetitions, "steps": bench.steps,
              "dtype": bench.dtype}  # fmt: skip
    if budget:
        result["budget"] = measure_budget(models, budget, bench)
    return result


def converted_table(result: dict) -> list[str]:
    """The grid as markdown: ms/step and the ratio to the source's default path in each cell."""
    return ratio_grid(result["grid"], "ms_per_step", "source")


def print_converted(result: dict) -> None:
    print(
        f"\ndecode ms/step continuing real text ({result.get('dtype', 'float32')}, {result['threads']} threads, "
        f"medians of {result['repetitions']} interleaved repetitions x {result['steps']} steps), ratio to the "
        "source's default path"
    )
    print("\n".join(converted_table(result)))
    if "budget" not in result:
        return
    budget = result["budget"]
    print(
        f"\nwith the source's cache at ({budget['batch']}, {budget['context']}) as the budget "
        f"({budget['budget_bytes'] / 2**20:,.1f} MiB), default paths:"
    )
    print("| model | cache bytes/token | sequences | ms/step | tokens/s | vs source |\n|---|---|---|---|---|---|")
    source = budget["models"]["source"]["tokens_per_s"]
    for name, row in budget["models"].items():
        print(
            f"| {name} | {row['cache_bytes_per_token']:,.0f} | {row['sequences']} | {row['ms_per_step']:.1f} "
            f"| {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / source:.2f}x |"
        )
