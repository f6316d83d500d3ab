"""Held-out scoring of a streamed conversion: the whole documents the whole-model conversion scores
(`pipeline.score_documents`), moved through each source layer and its converted student layer as they stream by,
both residual streams kept on the host; the source's final norm and head score the two at the end."""

from dataclasses import dataclass

import torch

from ..text import DocumentLosses, add_document_losses, document_batches, position_buckets
from ..training import bf16_autocast
from .layer_stream import run_layer, student_layer_output


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


def advance_documents(streams: DocumentStreams, source_layer, source_rotary, student, student_rotary) -> None:
    """Both streams past one layer: the source's (causal over each right-padded batch, as exact on the real tokens
    as a padding mask) and the student's."""
    with bf16_autocast(source_layer.input_layernorm.weight.device, streams.bf16):
        streams.source = [run_layer(source_layer, hidden, source_rotary, record=False)[1] for hidden in streams.source]
        streams.student = [student_layer_output(student, hidden, student_rotary) for hidden in streams.student]


@torch.no_grad()
def document_scores(streams: DocumentStreams, norm: torch.nn.Module, head: torch.Tensor, student_name: str) -> dict:
    """The source's and the student's held-out perplexity, overall and by position, as `score_documents` gives them."""
    scores = {}
    for name, hiddens in (("source", streams.source), (student_name, streams.student)):
        losses = DocumentLosses(position_buckets(streams.context))
        for hidden, (ids, mask) in zip(hiddens, streams.batches, strict=True):
            with bf16_autocast(head.device, streams.bf16):
                add_document_losses(
                    losses, hidden, ids, mask, lambda rows: torch.nn.functional.linear(norm(rows.to(head.device)), head)
                )
        scores[name] = losses.result()
    return {
        "perplexity": {name: score["perplexity"] for name, score in scores.items()},
        "perplexity_by_position": {name: score["buckets"] for name, score in scores.items()},
    }
