"""What a conversion report says: KV values per token measured on real caches, perplexities, a model card. Both
conversions (the whole-model one and the streamed one) fill one `ConversionReport`; its `as_dict` is
conversion_report.json, and everything here renders it."""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..hub import SourceMetadata, perplexity_result, save_card, source_metadata
from ..outputs import finite, is_number, report_json
from .fitting_text import held_out_dataset

SCORE_KEYS = ("perplexity", "perplexity_by_position", "extra_perplexity", "source_samples")


@dataclass
class ConversionReport:
    """What a conversion did and measured."""

    source: str  # the source's public name
    options: dict  # the `ConversionOptions` converted with (the split search's choice)
    budget: dict  # what they resolve to for this source (values per token per layer, the latent's width)
    reconstruction: dict  # the layer-wise fit's settings and per-layer rows, the gate's fit
    placement: dict  # device and dtype
    candidates: list = field(default_factory=list)  # the split search's rows (none when the split was given)
    text: dict = field(default_factory=dict)  # where the fitting and held-out text came from, how it was scored
    scores: dict = field(default_factory=dict)  # `scoring.figures`: held-out perplexities by model and text
    stages: list = field(default_factory=list)  # each fitting stage's loss on the blocks held aside, kept or not
    saved_stage: str | None = None
    kv: dict | None = None  # measured on `generate`'s caches (None: streamed, the budget's)
    finetune: dict | None = None  # the recovery's summary
    time_limit: float | None = None
    memory: dict | None = None  # the memory estimate
    decode: dict | None = None  # the decode cost against the source's, and a measured step
    samples: list = field(default_factory=list)  # greedy continuations side by side
    card: dict = field(default_factory=dict)  # the model card's metadata
    streamed: bool = False
    seconds: float = 0.0
    stage_seconds: dict = field(default_factory=dict)

    @property
    def perplexity(self) -> dict:
        return self.scores.get("perplexity", {})

    def as_dict(self) -> dict:
        """conversion_report.json: the text's description and the scores at the top level, and the first sample."""
        fields = {item.name: getattr(self, item.name) for item in dataclasses.fields(self)}
        flat = {name: value for name, value in fields.items() if name not in ("text", "scores")}
        if self.samples:
            flat["sample"] = self.samples[0]["prompt"] + self.samples[0]["converted"]["text"]
        return {**flat, **self.text, **self.scores}

    @classmethod
    def from_dict(cls, flat: dict) -> "ConversionReport":
        """A report read back from its JSON."""
        names = {item.name for item in dataclasses.fields(cls)} - {"text", "scores"}
        scores = {key: flat[key] for key in SCORE_KEYS if key in flat}
        text = {key: value for key, value in flat.items() if key not in names | set(SCORE_KEYS) | {"sample"}}
        return cls(**{name: flat[name] for name in names if name in flat}, text=text, scores=scores)


def job_card(job) -> dict:
    """A conversion job's model card metadata: the source's (or the job's `base_model` and `license`), the output's
    name, the held-out text as its dataset."""
    metadata = source_metadata(job.source, job.base_model, job.license)
    return {
        **dataclasses.asdict(metadata),
        "model_name": Path(job.out).name,
        "eval_dataset": held_out_dataset(job.text),
    }


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def extra_bytes(kv: dict) -> str:
    """The positions' bytes per token, where the mode caches them ("exact" rope)."""
    positions = kv.get("converted_position_bytes", 0)
    return f", {positions:.0f} B of position" if positions else ""


def kv_row(report: ConversionReport) -> tuple[str, str]:
    """The cache per token: measured on `generate`'s caches, or (a streamed conversion, never run whole) the budget's."""
    kv = report.kv
    if kv is None:
        budget = report.budget
        before, after = budget["source_values_per_token_per_layer"], budget["values_per_token_per_layer"]
        return "KV values / token / layer (the budget's)", f"{before} -> {after} ({1 - after / before:.2%} fewer)"
    return (
        "KV values / token / layer",
        f"{kv['source']:.1f} -> {kv['converted']:.1f} "
        f"({1 - kv['converted'] / kv['source']:.2%} fewer; + {kv['converted_token_id_bytes']:.0f} B of token id"
        f"{extra_bytes(kv)})",
    )


def windowed_row(budget: dict) -> list[tuple[str, str]]:
    """Where the source has windowed layers (Gemma 3's): that they were converted, and what their cache keeps."""
    windowed = budget.get("windowed_layers")
    if not windowed:
        return []
    return [("windowed layers", f"{len(windowed['layers'])} of {windowed['of']}, converted like the others; their "
                                f"cache keeps the last {windowed['window']} positions")]  # fmt: skip


def report_rows(report: ConversionReport) -> list[tuple[str, str]]:
    rows = [("source", report.source), kv_row(report), *windowed_row(report.budget)]
    gate = report.reconstruction.get("gate")
    if gate:
        fitted = [row for row in gate if row["fitted"]]
        identity = sum(row["attention_error"] for row in gate)
        kept = sum(row["attention_error_fitted" if row["fitted"] else "attention_error"] for row in gate)
        rows.append(
            (
                "fitted gate (least squares)",
                f"{len(fitted)} of {len(gate)} tables; attention error on calibration {kept / identity - 1:+.1%}",
            )
        )
    scored = "whole documents" + (", bf16 autocast" if report.text.get("scoring_autocast") else "")
    for name, value in report.perplexity.items():
        if value is not None:
            rows.append((f"held-out perplexity, {name}", f"{value:.3f} ({scored})"))
    source_ppl = report.perplexity.get("source")
    for name in ("zero-shot", "layer-wise", "fine-tuned"):
        value = report.perplexity.get(name)
        if source_ppl and value:
            rows.append((f"  {name} vs source", f"{value / source_ppl - 1:+.2%}"))
    rows += generality_rows(report)
    if report.stages:
        rows.append(("saved stage", stage_summary(report)))
    return rows + decode_rows(report.decode)


def versus(values: dict, name: str) -> str:
    """A model's figure, and against the source's where both are there."""
    value, source = values.get(name), values.get("source")
    if value is None:
        return "not a number"
    return f"{value:.3f}" + (f" ({value / source - 1:+.2%})" if source and name != "source" else "")


def generality_rows(report: ConversionReport) -> list[tuple[str, str]]:
    """Beyond the fitting domain: perplexity on each extra held-out text, and on the source's own samples held aside
    from every stage with the KL from the source's predictions (what a conversion keeps of its source in general)."""
    rows = []
    extra = report.scores.get("extra_perplexity", {})
    for text_name in dict.fromkeys(name for scores in extra.values() for name in scores):
        values = {model: scores[text_name] for model, scores in extra.items() if text_name in scores}
        rows.append((f"held-out perplexity, {text_name}", ", ".join(f"{m} {versus(values, m)}" for m in values)))
    samples = report.scores.get("source_samples", {})
    if samples:
        values = {model: row["perplexity"] for model, row in samples.items()}
        kl = ", ".join(
            f"{m} {row['kl_to_source']:.4f}"
            for m, row in samples.items()
            if m != "source" and row["kl_to_source"] is not None
        )
        count = report.text.get("held_aside_samples")
        rows.append((f"source's samples ({count} held aside)", ", ".join(f"{m} {versus(values, m)}" for m in values)))
        rows.append(("  KL to the source (nats/token)", kl))
    return rows


def samples_table(report: ConversionReport) -> str:
    """The source's and the converted model's greedy continuations of the same prompts, with their loops."""
    lines = []
    for row in report.samples:
        lines.append(f"\nprompt: {row['prompt']!r}")
        for name in ("source", "converted"):
            sample = row[name]
            lines.append(f"  {name:<9} ({sample['repeated_4grams']:.0%} repeated 4-grams): {sample['text']!r}")
    return "\n".join(lines)


def stage_summary(report: ConversionReport) -> str:
    """Which stage the saved model is, and each stage's loss on the blocks held aside from all fitting."""
    losses = [
        f"{row['stage']} {row['selection_loss']:.4f}{'' if row['kept'] else ' (not kept)'}"
        for row in report.stages
        if row["selection_loss"] is not None
    ]
    if not losses:
        return f"{report.saved_stage} (no blocks held aside to compare stages: every stage kept)"
    blocks = report.text.get("selection_blocks")
    return f"{report.saved_stage} (loss on {blocks} fitting blocks held aside: {', '.join(losses)})"


def decode_rows(decode: dict | None) -> list[tuple[str, str]]:
    """The decode side: what each cached token costs against the source, and a measured step."""
    if not decode:
        return []
    cost, source = decode["arithmetic"], decode["source_arithmetic"]
    measured = decode["measured"]
    cache = measured["cache_bytes_per_token"]
    ms = measured["ms_per_step"]
    return [
        ("cache bytes / token (all layers)", f"{cache['source']:,.0f} -> {cache['converted']:,.0f}"),
        (
            "attention per cached token/layer",
            f"{source['multiply_adds_per_token_per_layer']:,.0f} -> {cost['multiply_adds_per_token_per_layer']:,.0f} "
            f"multiply-adds ({cost['path']} decode, {cost['multiply_adds_vs_source']:.2f}x the source's)",
        ),
        (
            f"decode ms/step at ({measured['batch']}, {measured['context']})",
            f"{ms['source']:.1f} -> {ms['converted']:.1f} ({measured['ratio']:.2f}x the source's time)",
        ),
    ]


def position_table(report: ConversionReport) -> str:
    """Held-out perplexity per bucket of positions, one column per model (source, zero-shot, fine-tuned)."""
    by_position = report.scores.get("perplexity_by_position", {})
    if not by_position:
        return ""
    names = list(by_position)
    header = "| positions | tokens | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names)
    lines = [header]
    for index, bucket in enumerate(by_position[names[0]]):
        values = " | ".join(f"{by_position[name][index]['perplexity']:.3f}" for name in names)
        lines.append(f"| {bucket['start']}-{bucket['end']} | {bucket['tokens']:,} | {values} |")
    return "\n".join(lines)


def candidate_table(report: ConversionReport) -> str:
    """The splits the default search compared at the same budget (zero-shot, held-out calibration blocks)."""
    rows = report.candidates
    if not rows:
        return ""
    source = rows[0]["perplexity"]
    lines = [
        "| split | values/token/layer | perplexity | vs source | multiply-adds/cached token/layer | decode |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows[1:]:
        mark = " (chosen)" if row.get("chosen") else ""
        cost = row["cost"]
        lines.append(
            f"| {row['candidate']}{mark} | {row['values_per_token_per_layer']} | {row['perplexity']:.3f} "
            f"| {row['perplexity'] / source - 1:+.1%} | {cost['multiply_adds_per_token_per_layer']:,.0f} "
            f"({cost['multiply_adds_vs_source']:.2f}x) | {row['decode']} |"
        )
    return "\n".join(lines)


def print_report(report: ConversionReport) -> None:
    print("\nEG-MLA conversion report")
    print(format_table(report_rows(report)))
    if report.candidates:
        source = report.candidates[0]
        print(
            f"\nsplits compared at this budget (source {source['perplexity']:.3f}, "
            f"{source['cost']['multiply_adds_per_token_per_layer']:,.0f} multiply-adds per cached token per layer):"
        )
        print(candidate_table(report))
    if report.scores.get("perplexity_by_position"):
        print(f"\nheld-out perplexity by position ({report.text.get('eval_documents')} whole documents):")
        print(position_table(report))
    if report.samples:
        print("\nsamples side by side (greedy):" + samples_table(report))
    if report.stage_seconds:
        stages = ", ".join(f"{name} {seconds:g}" for name, seconds in report.stage_seconds.items())
        print(f"\nseconds by stage: {stages} (of {report.seconds:g} in all)")


def output_perplexity(report: ConversionReport) -> float | None:
    """The held-out perplexity of the model the folder holds: its saved stage's (else its last stage's)."""
    scores = report.perplexity
    if report.saved_stage:
        return scores.get(report.saved_stage)
    return next((scores[name] for name in ("fine-tuned", "layer-wise", "zero-shot") if scores.get(name)), None)


def gate_words(report: ConversionReport) -> str:
    """What the card says of the embedding gate, from the conversion options."""
    options = report.options
    if not options.get("gate_embedding_dim"):
        return "the embedding gate off: plain MLA"
    return f"the embedding gate on the {'rebuilt K/V' if options['gate_position'] == 'kv' else 'latent'}"


def measurement_words(report: ConversionReport) -> str:
    """How the card's measurements were made."""
    if report.streamed:
        fitted = report.reconstruction.get("layers")
        form = "with the layer-wise fit" if fitted else "in closed form"
        scored = (
            f"perplexities are on held-out documents never used for fitting, each scored whole from its first token "
            f"up to the source's context as the layers streamed by ({report.text['eval_text']})"
            if report.perplexity
            else "nothing was scored"
        )
        return (
            f"Converted {form} one layer at a time (`egmla convert --stream`): the cache size is the budget's, "
            f"{scored}; `egmla finetune` recovers it."
        )
    return (
        "KV values are read from the cache objects of real `generate` calls; perplexities are on held-out documents "
        "never used for fitting, each scored whole from its first token up to the source's context "
        f"({report.text.get('eval_text', 'see the report')})."
    )


# Licences whose terms ask every copy to carry a notice, by Hub licence id.
LICENCE_NOTICES = {
    "gemma": "Gemma is provided under and subject to the Gemma Terms of Use found at "
    "[ai.google.dev/gemma/terms](https://ai.google.dev/gemma/terms); this model, a modification of it, is too.",
}


def licence_notice(licence: str | None) -> str:
    return f"\n{LICENCE_NOTICES[licence]}\n" if licence in LICENCE_NOTICES else ""


def write_model_card(folder: Path, report: ConversionReport) -> None:
    """README.md (a Hub model card made by huggingface_hub, its metadata from `report.card`) and
    conversion_report.json in the output folder."""
    (folder / "conversion_report.json").write_text(report_json(report.as_dict()))
    # The card shows no NaN: a score that is not a number is left out.
    report = dataclasses.replace(
        report, **{item.name: finite(getattr(report, item.name)) for item in dataclasses.fields(report)}
    )
    card = report.card
    settings = "\n".join(
        f"| `{key}` | `{value}` |" for part in (report.options, report.budget) for key, value in part.items()
    )
    table = "\n".join(f"| {name} | {value} |" for name, value in report_rows(report))
    source = card.get("base_model") or report.source
    value = output_perplexity(report)
    results = [perplexity_result(value, card.get("eval_dataset"))] if is_number(value) else None
    body = f"""
# EG-MLA retrofit of `{source}`

This model is `{source}` converted by [egmla](https://pypi.org/project/egmla/) into Multi-head Latent
Attention (EG-MLA, arXiv 2509.16686, {gate_words(report)}): its K/V cache holds only a low-rank latent and a few
rotary key dims per token.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("<this folder or repo>", trust_remote_code=True)
```
{licence_notice(card.get("license"))}
## Measurements

| what | value |
|---|---|
{table}

{measurement_words(report)}

{position_table(report)}

{candidate_table(report)}

## Settings

The conversion options, then the budget they resolve to for this source (values per token per layer).

| setting | value |
|---|---|
{settings}
"""
    metadata = SourceMetadata(card.get("base_model"), card.get("license"), card.get("language"))
    save_card(folder, body, card.get("model_name") or "egmla-model", metadata, results, tags=["retrofit"])


def write_finetune_card(folder: Path, summary: dict) -> None:
    """README.md of an `egmla finetune` folder (a Hub model card made by huggingface_hub)."""
    summary = finite(summary)
    card = summary.get("card", {})
    scores = summary.get("perplexity", {})
    source = card.get("base_model") or summary["teacher"]
    saved = scores.get(summary.get("saved_stage", "after"))
    results = [perplexity_result(saved, card.get("eval_dataset"))] if is_number(saved) else None
    rows = "\n".join(f"| {name} | {value:.3f} |" for name, value in scores.items() if is_number(value))
    body = f"""
# EG-MLA retrofit of `{source}`, fine-tuned

The EG-MLA model `{summary["student"]}` (converted from `{source}` by [egmla](https://pypi.org/project/egmla/))
fine-tuned by distillation from `{summary["teacher"]}` for {summary["steps_done"]} steps; saved: the
{summary.get("saved_stage", "after")} stage (a stage is kept only if it lowers the loss on fitting text held aside).

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("<this folder or repo>", trust_remote_code=True)
```

## Held-out perplexity

Whole held-out documents never used for fitting ({summary.get("eval_text", "see the report")}).

| model | perplexity |
|---|---|
{rows}

The settings and the rest of the measurements are in `finetune_report.json`.
"""
    metadata = SourceMetadata(card.get("base_model"), card.get("license"), card.get("language"))
    save_card(folder, body, card.get("model_name") or "egmla-model", metadata, results, tags=["retrofit"])
