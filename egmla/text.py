"""Text to token blocks, and perplexity: shared by the quickstart, conversion, fine-tuning and the CLI."""

import math
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

DOCUMENT_SEPARATOR = "<|endoftext|>"


def read_documents(path: str | Path) -> list[str]:
    """The documents of a text file: `<|endoftext|>`-separated if it has the marker, else one document."""
    text = Path(path).read_text(encoding="utf-8")
    documents = [document.strip() for document in text.split(DOCUMENT_SEPARATOR)]
    return [document for document in documents if document]


def framed_ids(tokenizer: PreTrainedTokenizerBase, document: str) -> list[int]:
    """`<bos> document <eos>` as token ids (either marker left out where the tokenizer has none)."""
    ids = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    ids += tokenizer.encode(document, add_special_tokens=False)
    return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])


def token_blocks(
    tokenizer: PreTrainedTokenizerBase, documents: list[str], block_size: int, source: str = "The text"
) -> torch.Tensor:
    """Concatenates `<bos> document <eos>` for every document and cuts the stream into [N, block_size] blocks;
    `source` names the text in the error when it is shorter than one block."""
    stream: list[int] = []
    for document in documents:
        stream += framed_ids(tokenizer, document)
    usable = len(stream) // block_size * block_size
    if usable == 0:
        raise ValueError(
            f"{source} gives {len(stream)} tokens, fewer than one block of {block_size}: give more text, or a smaller "
            "--block-size."
        )
    return torch.tensor(stream[:usable]).view(-1, block_size)


def packed_blocks(blocks: torch.Tensor, length: int) -> torch.Tensor:
    """Consecutive blocks [N, S] joined into blocks [N * S // length, length] (S when `length` <= S): the blocks
    of `token_blocks` are one stream, so the joined ones are too."""
    if length <= blocks.shape[1]:
        return blocks
    usable = blocks.numel() // length * length
    if usable == 0:
        raise ValueError(f"{blocks.numel()} tokens are fewer than one block of {length}.")
    return blocks.flatten()[:usable].view(-1, length)


def split_documents(documents: list[str], held_out_fraction: float) -> tuple[list[str], list[str]]:
    """(fitting, held out): the held-out documents are the last ones and never used for fitting."""
    held_out = max(1, round(len(documents) * held_out_fraction))
    if held_out >= len(documents):
        raise ValueError(f"{len(documents)} documents are too few to hold out {held_out_fraction:.0%} of them.")
    return documents[:-held_out], documents[-held_out:]


@torch.no_grad()
def mean_loss(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 8, progress: bool = False) -> float:
    """Mean next-token cross-entropy (nats) over token blocks [N, S]."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    starts = range(0, len(blocks), batch_size)
    for start in tqdm(starts, desc="evaluating", unit="batch", leave=False, disable=not progress):
        batch = blocks[start : start + batch_size].to(device)
        total += model(batch, labels=batch, use_cache=False).loss.item() * len(batch)
        count += len(batch)
    model.train(was_training)
    return total / count


@torch.no_grad()
def loss_and_accuracy(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 8) -> tuple[float, float]:
    """Mean next-token cross-entropy (nats) and the fraction of next tokens predicted exactly (argmax)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total_loss, correct, count = 0.0, 0, 0
    for start in range(0, len(blocks), batch_size):
        batch = blocks[start : start + batch_size].to(device)
        outputs = model(batch, labels=batch, use_cache=False)
        total_loss += outputs.loss.item() * len(batch)
        correct += (outputs.logits[:, :-1].argmax(-1) == batch[:, 1:]).sum().item()
        count += len(batch)
    model.train(was_training)
    return total_loss / count, correct / (count * (blocks.shape[1] - 1))


def perplexity(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 8, progress: bool = False) -> float:
    return math.exp(mean_loss(model, blocks, batch_size, progress))


@torch.no_grad()
def sample_agreement(model: torch.nn.Module, source: torch.nn.Module, documents: list[torch.Tensor]) -> dict:
    """A model's perplexity on the source's own samples and its mean KL(source || model) per predicted token (nats):
    how much of the source's general behaviour a conversion keeps, measured without any corpus."""
    device = next(model.parameters()).device
    nll, kl, count = 0.0, 0.0, 0
    for ids, mask in document_batches(documents, batch_size=4):  # [4, T, V] logits of a large vocabulary, twice
        ids, mask = ids.to(device), mask.to(device)
        logits = model(ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
        log_probs = torch.log_softmax(logits, dim=-1)
        if model is source:
            source_log_probs = log_probs
        else:
            source_logits = source(ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
            source_log_probs = torch.log_softmax(source_logits, dim=-1)
        valid = mask[:, 1:].bool()
        nll -= log_probs.gather(-1, ids[:, 1:, None])[..., 0][valid].sum().item()
        token_kl = (source_log_probs.exp() * (source_log_probs - log_probs)).sum(-1)
        kl += token_kl[valid].sum().item()
        count += int(valid.sum())
    return {"perplexity": math.exp(nll / count), "kl_to_source": kl / count, "tokens": count}


def document_ids(tokenizer: PreTrainedTokenizerBase, documents: list[str], max_length: int) -> list[torch.Tensor]:
    """Each document as `<bos> document <eos>`, whole up to `max_length` tokens (the source's context)."""
    encoded = [torch.tensor(framed_ids(tokenizer, document)[:max_length]) for document in documents]
    return [ids for ids in encoded if len(ids) > 1]


def position_buckets(context_length: int, first: int = 128) -> list[int]:
    """Bucket edges 0, 128, 256, 512, ... up to the context length."""
    edges, edge = [0], first
    while edge < context_length:
        edges.append(edge)
        edge *= 2
    return edges + [context_length]


def document_batches(documents: list[torch.Tensor], batch_size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Whole documents as right-padded batches (ids [B, T], mask [B, T]), shortest first: little padding per batch."""
    order = sorted(range(len(documents)), key=lambda index: len(documents[index]))
    batches = []
    for start in range(0, len(order), batch_size):
        batch = [documents[index] for index in order[start : start + batch_size]]
        ids = torch.nn.utils.rnn.pad_sequence(batch, batch_first=True, padding_value=0)
        batches.append((ids, torch.nn.utils.rnn.pad_sequence([torch.ones_like(d) for d in batch], batch_first=True)))
    return batches


class DocumentLosses:
    """The next-token losses of whole documents summed overall and per bucket of the predicted token's position
    ([edges[i], edges[i+1])), a batch of logits at a time."""

    def __init__(self, edges: list[int]):
        self.edges = edges
        self.nll = torch.zeros(len(edges) - 1, dtype=torch.float64)
        self.count = torch.zeros(len(edges) - 1, dtype=torch.float64)

    def add(self, logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """logits [B, T-1, V] predicting ids[:, 1:] of a `document_batches` batch."""
        # over rows of [B*T, V]: the [B, V, T] layout of a transposed view is several times slower on a CPU
        losses = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1).to(logits.device), reduction="none"
        )
        losses = losses.view(ids.shape[0], -1).cpu()
        valid = mask[:, 1:].bool().cpu()
        positions = torch.arange(1, ids.shape[1]).expand_as(valid)  # the position of each predicted token
        bucket = torch.bucketize(positions.contiguous(), torch.tensor(self.edges[1:-1]), right=True)
        self.nll.index_add_(0, bucket[valid], losses[valid].double())
        self.count.index_add_(0, bucket[valid], torch.ones(int(valid.sum()), dtype=torch.float64))

    def result(self) -> dict:
        edges, nll, count = self.edges, self.nll, self.count
        rows = [
            {"start": edges[i], "end": edges[i + 1], "tokens": int(count[i]), "perplexity": math.exp(nll[i] / count[i])}
            for i in range(len(count))
            if count[i] > 0
        ]
        return {"perplexity": math.exp(nll.sum() / count.sum()), "tokens": int(count.sum()), "buckets": rows}


# The model types whose logits are their output head over their decoder's last hidden states (no logit scale or
# soft-capping): scored from those hidden states, a document's logits at a time.
PLAIN_HEAD_MODEL_TYPES = ("egmla", "llama", "mistral", "qwen2")


def add_document_losses(
    losses: DocumentLosses, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, head
) -> None:
    """A `document_batches` batch's losses from its last hidden states [B, T, D], `head` making one document's
    logits at a time over its own tokens: a batch's [B, T, V] of a large vocabulary outweighs the model."""
    for row, length in enumerate(mask.sum(dim=1).tolist()):
        logits = head(hidden[row : row + 1, : length - 1])
        losses.add(logits, ids[row : row + 1, :length], mask[row : row + 1, :length])


@torch.no_grad()
def document_perplexity(
    model: torch.nn.Module, documents: list[torch.Tensor], edges: list[int], batch_size: int = 8, progress: bool = False
) -> dict:
    """Perplexity over whole documents, each scored from its first token, overall and per bucket of the position
    of the predicted token ([edges[i], edges[i+1]))."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    losses = DocumentLosses(edges)
    batches = document_batches(documents, batch_size)
    plain_head = getattr(getattr(model, "config", None), "model_type", None) in PLAIN_HEAD_MODEL_TYPES
    for ids, mask in tqdm(batches, desc="scoring documents", unit="batch", leave=False, disable=not progress):
        inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device), "use_cache": False}
        if plain_head:
            hidden = model.get_decoder()(**inputs).last_hidden_state
            add_document_losses(losses, hidden, ids, mask, model.get_output_embeddings())
        else:
            losses.add(model(**inputs).logits[:, :-1], ids, mask)
    model.train(was_training)
    return losses.result()
