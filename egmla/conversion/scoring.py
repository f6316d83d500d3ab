"""Judging a conversion: the held-out documents scored whole, from their first token up to the source's context (the
report's figures), and the stage selection that keeps a fitting stage only if it lowers the loss on blocks held aside
from every stage. The figures come from each model's last hidden states over the documents, however they were
reached: a whole model's forward pass (`score_documents`), or, in a streamed conversion, the source's and the
student's residual streams moved through each layer as it went by (`DocumentStreams`); `figures` builds the same
table from either."""

import math
from dataclasses import dataclass, field

import torch

from ..precision import bf16_autocast
from ..text import (
    DocumentLosses,
    add_document_losses,
    document_batches,
    document_perplexity,
    mean_loss,
    position_buckets,
    sample_agreement,
)
from .fitting_text import TextData
from .layer_source import run_layer, student_layer_output


def figures(held_out: dict[str, dict], extra: dict[str, dict[str, float]], samples: dict | None = None) -> dict:
    """The report's table: by model, the held-out perplexity overall and by position (`DocumentLosses.result()`s),
    on every extra held-out text by its name, and the agreement with the source on its held-aside samples."""
    return {
        "perplexity": {name: result["perplexity"] for name, result in held_out.items()},
        "perplexity_by_position": {name: result["buckets"] for name, result in held_out.items()},
        "extra_perplexity": extra,
        "source_samples": samples or {},
    }


def score_documents(models: dict[str, torch.nn.Module], text: TextData, source: torch.nn.Module) -> dict:
    """The `figures` of whole models, each under the scoring's autocast."""
    edges = position_buckets(text.description["eval_context"])
    held_out, extra, samples = {}, {}, {}
    for name, model in models.items():
        with bf16_autocast(model.device, text.bf16_scoring):
            held_out[name] = document_perplexity(model, text.documents, edges, progress=True)
            extra[name] = {
                text_name: document_perplexity(model, documents, edges)["perplexity"]
                for text_name, documents in text.extra_documents.items()
            }
            if text.source_samples:
                samples[name] = sample_agreement(model, source, text.source_samples)
    return figures(held_out, extra, samples)


@dataclass
class DocumentStreams:
    """Right-padded batches of whole held-out documents (ids, mask [B, T]) and the source's and the student's
    residual streams over them [B, T, D], on the host."""

    batches: list[tuple[torch.Tensor, torch.Tensor]]
    source: list[torch.Tensor]
    student: list[torch.Tensor]
    context: int  # the source's: the position buckets' last edge
    bf16: bool = False  # scored under bfloat16 autocast, as `TextData.bf16_scoring`


def document_streams(
    documents: list[torch.Tensor], embeddings: torch.Tensor, context: int, bf16: bool = False
) -> DocumentStreams:
    """The documents' embeddings [B, T, D] (in `embeddings`' dtype), a copy for each model."""
    batches = document_batches(documents)
    source = [torch.nn.functional.embedding(ids, embeddings) for ids, _ in batches]
    return DocumentStreams(batches, source, [hidden.clone() for hidden in source], context, bf16)


def advance_documents(streams: DocumentStreams, source_layer, source_rotary, student, student_rotary, table=None):
    """Both streams past one layer: the source's (causal over each right-padded batch, as exact on the real tokens
    as a padding mask) and the student's (with its gate `table`, if any)."""
    with bf16_autocast(source_layer.input_layernorm.weight.device, streams.bf16):
        streams.source = [run_layer(source_layer, hidden, source_rotary, record=False)[1] for hidden in streams.source]
        streams.student = [
            student_layer_output(student, hidden, student_rotary, None if table is None else (table, ids))
            for hidden, (ids, _) in zip(streams.student, streams.batches, strict=True)
        ]


@torch.no_grad()
def stream_perplexity(hidden: torch.Tensor, blocks: torch.Tensor, norm: torch.nn.Module, head: torch.Tensor) -> float:
    """Next-token perplexity of a final residual stream [M, L, D] over its blocks [M, L], a block at a time."""
    total = 0.0
    for states, ids in zip(hidden, blocks, strict=True):
        logits = torch.nn.functional.linear(norm(states.to(head.device)), head).float()
        total += torch.nn.functional.cross_entropy(logits[:-1], ids[1:].to(head.device)).item()
    return math.exp(total / len(blocks))


@torch.no_grad()
def stream_results(streams: DocumentStreams, norm: torch.nn.Module, head: torch.Tensor, student_name: str) -> dict:
    """The source's and the student's `DocumentLosses.result()` from their streams past the last layer."""
    results = {}
    for name, hiddens in (("source", streams.source), (student_name, streams.student)):
        losses = DocumentLosses(position_buckets(streams.context))
        for hidden, (ids, mask) in zip(hiddens, streams.batches, strict=True):
            with bf16_autocast(head.device, streams.bf16):
                add_document_losses(
                    losses, hidden, ids, mask, lambda rows: torch.nn.functional.linear(norm(rows.to(head.device)), head)
                )
        results[name] = losses.result()
    return results


def score_streams(
    streams: DocumentStreams, extra: dict[str, DocumentStreams], norm_and_head: tuple, student_name: str
) -> dict:
    """The `figures` of the source and the student from their streams (the held-out documents' and every extra
    held-out text's)."""
    norm, head = norm_and_head
    extra_perplexity = {"source": {}, student_name: {}}
    for text_name, text_streams in extra.items():
        for model, result in stream_results(text_streams, norm, head, student_name).items():
            extra_perplexity[model][text_name] = result["perplexity"]
    return figures(stream_results(streams, norm, head, student_name), extra_perplexity)


@dataclass
class StageSelection:
    """Never worse than an earlier stage: each fitting stage is kept only if it lowers the next-token loss on the
    blocks held aside from all fitting; otherwise the model is put back to the best stage so far. Without such
    blocks (a text of fewer than 8 blocks) every stage is kept, and the report says so."""

    blocks: torch.Tensor
    bf16: bool = False  # the losses under bfloat16 autocast, as the held-out scoring (`TextData.bf16_scoring`)
    rows: list[dict] = field(default_factory=list)
    best_loss: float = math.inf
    best_state: dict | None = None

    def consider(self, stage: str, model: torch.nn.Module) -> bool:
        with bf16_autocast(next(model.parameters()).device, self.bf16):
            loss = mean_loss(model, self.blocks) if len(self.blocks) else None
        if loss is not None and not math.isfinite(loss):
            loss = math.inf
        kept = loss is None or self.best_state is None or loss < self.best_loss
        if kept and loss is not None:
            self.best_loss = loss
            # On the host: the accelerator holds the model being fitted, not its copies.
            self.best_state = {
                name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()
            }
        elif not kept:
            model.load_state_dict(self.best_state)
        self.rows.append({"stage": stage, "selection_loss": loss, "kept": kept})
        return kept

    @property
    def saved_stage(self) -> str:
        return [row["stage"] for row in self.rows if row["kept"]][-1]


def add_scores(scores: dict, more: dict) -> None:
    """Merges a later stage's `score_documents` into the earlier stages' (both keyed by figure, then model)."""
    for figure, by_model in more.items():
        scores[figure].update(by_model)
