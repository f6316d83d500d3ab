"""Held-out scoring of whole documents, as a conversion's report scores them: the model's logits for a whole batch
(`model(...).logits`) against egmla's `document_perplexity` (the decoder's last hidden states, the head applied a
document at a time over its own tokens), in float32 and under bfloat16 autocast (what a conversion's report uses
where the device computes bfloat16 natively and the model is 512 wide or more). Seconds interleaved in one process
(medians), the perplexity of each, and the peak resident memory of each in a process of its own.

    python benchmarks/conversion/document_scoring.py SOURCE --text T          # SOURCE: a Llama folder or GGUF
    python benchmarks/conversion/document_scoring.py runs/llama-1b --text T --documents 20 --repetitions 1
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from egmla.conversion.fitting_text import TextSettings, fitting_and_held_out
from egmla.conversion.source import load_llama, load_tokenizer
from egmla.precision import bf16_autocast
from egmla.text import (
    DocumentLosses,
    document_batches,
    document_ids,
    document_perplexity,
    position_buckets,
)


@torch.no_grad()
def whole_batch_logits(model: torch.nn.Module, documents: list[torch.Tensor], edges: list[int]) -> dict:
    """The baseline: every batch's logits [B, T, V] at once."""
    losses = DocumentLosses(edges)
    for ids, mask in document_batches(documents):
        losses.add(model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1], ids, mask)
    return losses.result()


def under_bf16_autocast(model: torch.nn.Module, documents: list[torch.Tensor], edges: list[int]) -> dict:
    with bf16_autocast(model.device, True):
        return document_perplexity(model, documents, edges)


SCORERS = {
    "whole-batch logits": whole_batch_logits,
    "document_perplexity (egmla)": document_perplexity,
    "document_perplexity, bf16 autocast": under_bf16_autocast,
}


def held_out(args: argparse.Namespace, model: torch.nn.Module) -> list[torch.Tensor]:
    """The documents a conversion with this text scores: its last 10%, whole up to the source's context."""
    _, documents, _ = fitting_and_held_out(TextSettings(train_text=Path(args.text)))
    context = model.config.max_position_embeddings
    return document_ids(load_tokenizer(args.source), documents[: args.documents], context)


def peak_rss_of(args: argparse.Namespace, scorer: str) -> float:
    """The peak resident GB of a process that loads the model and scores once with `scorer`."""
    command = [sys.executable, __file__, args.source, "--text", args.text, "--documents", str(args.documents)]
    output = subprocess.run([*command, "--only", scorer], check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])["peak_rss_gb"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("--text", required=True, help="the fitting text; its last 10%% of documents are scored")
    parser.add_argument("--documents", type=int, default=100)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--only", choices=SCORERS, help=argparse.SUPPRESS)  # the child process of peak_rss_of
    args = parser.parse_args()
    model = load_llama(args.source).eval()
    documents = held_out(args, model)
    edges = position_buckets(model.config.max_position_embeddings)
    if args.only:
        SCORERS[args.only](model, documents, edges)
        print(json.dumps({"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
        return
    seconds, results = {name: [] for name in SCORERS}, {}
    for _ in range(args.repetitions):
        for name, scorer in SCORERS.items():
            started = time.perf_counter()
            results[name] = scorer(model, documents, edges)
            seconds[name].append(time.perf_counter() - started)
    tokens = sum(len(document) - 1 for document in documents)
    print(f"{len(documents)} documents, {tokens:,} predicted tokens, vocabulary {model.config.vocab_size:,}")
    baseline = statistics.median(seconds["whole-batch logits"])
    for name in SCORERS:
        median = statistics.median(seconds[name])
        print(
            f"  {name:34s} {median:7.1f} s ({median / baseline:.2f}x)  perplexity {results[name]['perplexity']:.4f}"
            f"  peak RSS {peak_rss_of(args, name):.2f} GB"
        )


if __name__ == "__main__":
    main()
