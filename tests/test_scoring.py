"""Held-out scoring of whole documents (`egmla.text.document_perplexity`): the Llama families and EG-MLA are scored
from their decoder's last hidden states, a document's logits at a time over its own tokens; every model, that way or
from its logits, gets the scores of its whole-batch logits, overall and by position."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from egmla.text import DocumentLosses, document_batches, document_perplexity
from tests.utils import tiny_model, tiny_source

# More documents than a batch of 8, of unequal lengths (right padding in every batch), one of two tokens.
LENGTHS = (5, 17, 40, 2, 33, 9, 12, 28, 3, 64, 21)


def whole_batch_scores(model: torch.nn.Module, documents: list[torch.Tensor], edges: list[int]) -> dict:
    losses = DocumentLosses(edges)
    with torch.no_grad():
        for ids, mask in document_batches(documents):
            losses.add(model(input_ids=ids, attention_mask=mask).logits[:, :-1], ids, mask)
    return losses.result()


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=128, n_embd=32, n_layer=2, n_head=4)).eval()


MODELS = {
    "llama": lambda: tiny_source("llama"),
    "qwen2": lambda: tiny_source("qwen2"),
    "mistral": lambda: tiny_source("mistral"),
    "egmla": lambda: tiny_model(vocab_size=96),
    "gpt2 (scored from its logits)": tiny_gpt2,
}


@pytest.mark.parametrize("name", MODELS)
def test_document_scores_equal_the_whole_batch_logits(name):
    model = MODELS[name]()
    generator = torch.Generator().manual_seed(0)
    documents = [torch.randint(3, 96, (length,), generator=generator) for length in LENGTHS]
    edges = [0, 8, 32, 64]  # the position buckets
    expected, scored = whole_batch_scores(model, documents, edges), document_perplexity(model, documents, edges)
    assert scored["tokens"] == expected["tokens"] == sum(LENGTHS) - len(LENGTHS)
    assert scored["perplexity"] == pytest.approx(expected["perplexity"], rel=1e-5)
    assert [row["tokens"] for row in scored["buckets"]] == [row["tokens"] for row in expected["buckets"]]
    assert [row["perplexity"] for row in scored["buckets"]] == pytest.approx(
        [row["perplexity"] for row in expected["buckets"]], rel=1e-5
    )
    assert len(scored["buckets"]) > 1
