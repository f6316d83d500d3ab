"""Draws the paper's four panels from the JSON results into one PNG, plus a markdown table."""

import json
from pathlib import Path

from .decode import column_label, decode_table
from .models import LABELS


def load(results: Path, name: str) -> dict:
    path = results / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `egmla bench {name}` first (or pass --results).")
    return json.loads(path.read_text())


COLORS = {"mha": "#999999", "mla-base": "#4c72b0", "egmla-kv64": "#dd8452", "egmla-kv16": "#c44e52"}


def labelled_bars(ax, names: list[str], values: list[float], labels: list[str], ticks: list[str] | None = None) -> None:
    """One bar per model, its label above it, model names (or `ticks`) under the axis."""
    colors = [COLORS.get(name.removesuffix("-static"), "#8172b3") for name in names]
    bars = ax.bar(range(len(names)), values, color=colors)
    for bar, label in zip(bars, labels, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), label, ha="center", va="bottom", fontsize=7)
    ticks = ticks or [LABELS[name] for name in names]
    ticks = [tick.replace(" (transformers)", "\n(transformers)").replace(", ", ",\n") for tick in ticks]
    ax.set_xticks(range(len(names)), ticks, fontsize=6, rotation=90)
    ax.set_ylim(top=max(values) * 1.2)  # room for the labels


def accuracy_panel(ax, train: dict) -> None:
    """(a) held-out next-token accuracy vs training tokens."""
    for name, run in train["runs"].items():
        tokens = [point["tokens"] / 1e6 for point in run["curve"]]
        accuracy = [100 * point["accuracy"] for point in run["curve"]]
        style = "--" if run["gate_embedding_dim"] == 0 else "-"
        ax.plot(tokens, accuracy, style, marker="o", markersize=3, label=name)
    ax.set(title="(a) accuracy vs training tokens", xlabel="training tokens (M)", ylabel="held-out next-token acc. (%)")
    ax.legend(fontsize=7)


def gate_size_panel(ax, train: dict) -> None:
    """(b) final held-out loss vs gate-table parameters; MLA (gate off, the widest latent) as a flat line."""
    widest = max(run["kv_lora_rank"] for run in train["runs"].values())
    egmla = [run for run in train["runs"].values() if run["kv_lora_rank"] != widest]
    mla = [run for run in train["runs"].values() if run["kv_lora_rank"] == widest]
    ax.plot(
        [run["gate_table_parameters"] / 1e3 for run in egmla],
        [run["held_out_loss"] for run in egmla],
        "o-",
        label=f"EG-MLA, latent {egmla[0]['kv_lora_rank']}",
    )
    for run in mla:
        ax.axhline(run["held_out_loss"], linestyle="--", color="gray", label=f"MLA, latent {run['kv_lora_rank']}")
    ax.set(title="(b) loss vs gate embedding size", xlabel="gate-table parameters (K)", ylabel="held-out loss (nats)")
    ax.legend(fontsize=7)


def cache_panel(ax, kv: dict) -> None:
    """(c) K/V cache elements per token."""
    names = list(kv["rows"])
    labelled_bars(
        ax,
        names,
        [kv["rows"][name]["elements_per_token"] for name in names],
        [f"{kv['rows'][name]['elements_per_token']:,.0f}\n{kv['rows'][name]['vs_mha']:+.1%}" for name in names],
    )
    ax.set(title=f"(c) KV cache elements per token ({kv['layers']} layers)", ylabel="elements / token")


def decode_panel(ax, decode: dict) -> None:
    """(d) decode latency: the largest context at the largest batch, where the cache's size weighs most."""
    largest_batch = max(r["batch"] for r in decode["grid"])
    row = max((r for r in decode["grid"] if r["batch"] == largest_batch), key=lambda r: r["context"])
    ms = row["ms_per_token"]
    names = list(ms)
    labels = [f"{ms[n]:.0f}\n{ms[n] / ms['mha']:.2f}x" for n in names]
    labelled_bars(ax, names, [ms[n] for n in names], labels, [column_label(n) for n in names])
    ax.set(title=f"(d) decode, batch {row['batch']}, context {row['context']} (CPU)", ylabel="ms / token")


def draw_figure(results: Path) -> tuple[Path, Path]:
    """Writes `figure.png` and `figure.md` into `results`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kv, decode, train = load(results, "kv"), load(results, "decode"), load(results, "train")
    figure, axes = plt.subplots(1, 4, figsize=(22, 5.6))
    accuracy_panel(axes[0], train)
    gate_size_panel(axes[1], train)
    cache_panel(axes[2], kv)
    decode_panel(axes[3], decode)
    figure.tight_layout()
    png = results / "figure.png"
    figure.savefig(png, dpi=80)
    plt.close(figure)
    markdown = results / "figure.md"
    markdown.write_text(tables(kv, decode, train))
    return png, markdown


def tables(kv: dict, decode: dict, train: dict) -> str:
    lines = [f"(c) K/V cache elements per token, {kv['layers']} layers, measured on real caches after generate:", ""]
    lines += ["| model | elements/token | expected | vs MHA | vs MLA-Base |", "|---|---|---|---|---|"]
    for row in kv["rows"].values():
        lines.append(
            f"| {row['label']} | {row['elements_per_token']:,.0f} | {row['expected']:,} | {row['vs_mha']:+.1%} "
            f"| {row['vs_mla_base']:+.1%} |"
        )
    lines += ["", f"(d) decode ms/token on the CPU, {decode['layers']} layers (ratio to MHA's default path):", ""]
    lines += decode_table(decode)
    budget = decode["budget"]
    lines += ["", f"Tokens/s with a {budget['mib']:g} MiB cache budget at context {budget['context']}:", ""]
    lines += ["| model | sequences | ms/step | tokens/s |", "|---|---|---|---|"]
    for name, row in budget["models"].items():
        lines.append(f"| {LABELS[name]} | {row['sequences']} | {row['ms_per_step']:.1f} | {row['tokens_per_s']:.1f} |")
    lines += ["", "(a, b) from-scratch training (held-out TinyStories):", ""]
    lines += ["| run | latent | gate width | gate-table params | tokens | held-out loss | held-out accuracy |"]
    lines += ["|---|---|---|---|---|---|---|"]
    for name, run in train["runs"].items():
        lines.append(
            f"| {name} | {run['kv_lora_rank']} | {run['gate_embedding_dim']} | {run['gate_table_parameters']:,} "
            f"| {run['tokens']:,} | {run['held_out_loss']:.4f} | {run['held_out_accuracy']:.4f} |"
        )
    return "\n".join(lines) + "\n"
