"""Where a decode step of a converted model goes, against its source: one greedy step at (batch, context) over a
prefilled cache of real text, split by module (timers on the modules' forward hooks; the CPU runs one op at a time,
so wall time between a module's entry and exit is its cost), medians over repetitions, each model in turn.

    python benchmarks/decode/converted_breakdown.py SRC OUT [OUT ...] [--cells 1x512 8x2048] [--repetitions 5]

Rows: the attention's projections (its weights), the attention's core (everything else inside the attention module:
rope, cache update, the scores and the weighted sum over the cache, the absorbed query and output), the MLP, the
norms, the embedding and the output head, and the rest of the step (the model's own bookkeeping: masks, position
embeddings, the gate lookup). The hooks cost a few microseconds each; the whole step is also timed without them.
"""

import argparse
import statistics
import time
from collections import defaultdict

import torch

from egmla.bench.converted import CELLS, ConvertedBench, load_models, prefilled, text_rows
from egmla.measure import DecodeState

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")
ROWS = ("attention projections", "attention core", "MLP", "norms", "embedding", "output head", "rest of the step")


def category(name: str) -> str | None:
    """The row of a module by its name (None: not timed on its own)."""
    last = name.rsplit(".", 1)[-1]
    if ".self_attn." in f".{name}." and last in PROJECTIONS:
        return "attention projections"
    if last == "self_attn":
        return "attention"
    if last == "mlp":
        return "MLP"
    if last in ("input_layernorm", "post_attention_layernorm") or name == "model.norm":
        return "norms"
    if last == "embed_tokens":
        return "embedding"
    if name == "lm_head":
        return "output head"
    return None


class ModuleTimers:
    """Forward hooks that add each timed module's wall time to its row."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.handles = []
        for name, module in model.named_modules():
            row = category(name)
            if row is not None:
                self.handles.append(module.register_forward_pre_hook(self.enter))
                self.handles.append(module.register_forward_hook(self.leave_hook(row)))

    def enter(self, module, args) -> None:
        module._entered = time.perf_counter()

    def leave_hook(self, row: str):
        def leave(module, args, output) -> None:
            self.seconds[row] += time.perf_counter() - module._entered

        return leave

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def timed_step(state: DecodeState, model: torch.nn.Module) -> dict[str, float]:
    """ms of one step by row, and the step with and without the hooks."""
    started = time.perf_counter()
    state.step()
    plain = time.perf_counter() - started
    timers = ModuleTimers(model)
    started = time.perf_counter()
    state.step()
    hooked = time.perf_counter() - started
    timers.remove()
    seconds = dict(timers.seconds)
    seconds["attention core"] = seconds.pop("attention", 0.0) - seconds.get("attention projections", 0.0)
    seconds["rest of the step"] = hooked - sum(seconds.values())
    return {**{row: 1000 * seconds.get(row, 0.0) for row in ROWS}, "step": 1000 * plain}


@torch.no_grad()
def breakdown(models: dict, bench: ConvertedBench, batch_size: int, context: int, repetitions: int) -> dict:
    rows = text_rows(bench, batch_size, context)
    states = {}
    for name, model in models.items():
        cache = prefilled(model, rows[:, :-1])
        states[name] = DecodeState(model.forward, cache, rows[:, -1:], torch.full((batch_size, 1), context))
    for name, state in states.items():  # warm-up
        timed_step(state, models[name])
    samples = {name: [] for name in states}
    for _ in range(repetitions):
        for name, state in states.items():
            samples[name].append(timed_step(state, models[name]))
    return {
        name: {row: statistics.median(sample[row] for sample in runs) for row in (*ROWS, "step")}
        for name, runs in samples.items()
    }


def print_breakdown(result: dict, batch_size: int, context: int) -> None:
    names = list(result)
    print(f"\nbatch {batch_size}, context {context}: ms per decode step (median), converted / source")
    print("| part | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    source = result["source"]
    for row in (*ROWS, "step"):
        cells = [f"{result[name][row]:.1f}" for name in names[:1]]
        for name in names[1:]:
            ratio = result[name][row] / source[row] if source[row] > 0.05 else float("nan")
            cells.append(f"{result[name][row]:.1f} ({ratio:.2f}x)")
        label = "whole step (no hooks)" if row == "step" else row
        print(f"| {label} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("converted", nargs="+")
    parser.add_argument("--cells", nargs="+", default=[f"{b}x{t}" for b, t in CELLS[::2]])
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args()
    bench = ConvertedBench(args.source, args.converted, compiled=False)
    models = load_models(bench)
    for cell in args.cells:
        batch_size, context = (int(part) for part in cell.split("x"))
        print_breakdown(breakdown(models, bench, batch_size, context, args.repetitions), batch_size, context)


if __name__ == "__main__":
    main()
