"""The source's own text: samples from varied prompts at several temperatures, loops dropped, for data-free fitting,
for a share of every fitting stage beside a user's text, and (held aside) for measuring what a conversion keeps of
its source's general behaviour."""

import dataclasses
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

# Openings in many registers, so that samples are not one genre (every source gets them).
OPENINGS = (
    "The history of", "In 1887,", "Scientists have found that", "Dear Sarah,", "Once upon a time",
    "The recipe calls for", "According to the report,", "The city council voted", "My favourite book is",
    "The theory of", "How to", "In this chapter we", "The weather today", "She opened the door and",
    "The company announced", "There are three reasons why",
)  # fmt: skip
# Requests for a source with a chat template, each put inside it (an instruct model's own kind of text).
REQUESTS = (
    "Write a short story about a lighthouse keeper.", "Explain how vaccines work.",
    "Summarize the causes of the First World War.", "Give me three tips for learning a new language.",
    "Write a poem about autumn.", "What is the difference between weather and climate?", "Describe the water cycle.",
    "Write an email asking my manager for a day off.", "Explain recursion to a beginner.",
    "What does the liver do?", "Write a product description for a bicycle.", "Tell me about the Roman Empire.",
    "How does a bank loan work?", "Write a dialogue between a teacher and a student.", "Explain photosynthesis.",
    "Suggest some healthy breakfast ideas.",
)  # fmt: skip


@dataclass(frozen=True)
class Sampling:
    """How much of the source's text to sample, and how."""

    tokens: int  # at least this many, in whole samples
    samples: int = 0  # or at least this many samples (0: no count)
    temperatures: tuple[float, ...] = (0.7, 0.85, 1.0)  # cycled batch by batch
    seed: int = 0
    new_tokens: int = 256  # at most, per sample (a sample ends early at the end-of-text token)
    batch_size: int = 64
    max_repetition: float = 0.3  # a sample whose share of repeated 4-grams is higher loops: dropped

    def __post_init__(self) -> None:
        if not self.temperatures or min(self.temperatures) <= 0:
            raise ValueError(f"sample temperatures must be positive, got {self.temperatures}.")


def source_prompts(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Token ids of every prompt: the openings, and for a source with a chat template the requests inside it."""
    start = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    prompts = [start + tokenizer.encode(opening, add_special_tokens=False) for opening in OPENINGS]
    if getattr(tokenizer, "chat_template", None):
        for request in REQUESTS:
            messages = [{"role": "user", "content": request}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def repeated_ngram_share(ids: list[int] | torch.Tensor, n: int = 4) -> float:
    """The share of a sequence's n-grams that repeat an earlier one (0: none; near 1: a loop)."""
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as ids [B, T] and attention mask [B, T], padded on the left."""
    length = max(map(len, prompts))
    ids = torch.full((len(prompts), length), pad_id)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt) :], mask[row, length - len(prompt) :] = torch.tensor(prompt), 1
    return ids, mask


@torch.no_grad()
def sample_batch(model, tokenizer, prompts: list[list[int]], temperature: float, sampling: Sampling) -> list[list[int]]:
    """One batch of samples: each its prompt, then its new tokens up to and with the end-of-text token."""
    end = tokenizer.eos_token_id
    pad = end if end is not None else 0  # masked out: any id the model embeds (a tokenizer's pad may lie past it)
    ids, mask = left_padded(prompts, pad)
    device = next(model.parameters()).device
    out = model.generate(
        ids.to(device), attention_mask=mask.to(device), do_sample=True, temperature=temperature, top_k=0,
        top_p=1.0, max_new_tokens=sampling.new_tokens, pad_token_id=pad,
    ).cpu()  # fmt: skip
    samples = []
    for row, prompt in enumerate(prompts):
        new = out[row, ids.shape[1] :].tolist()
        if end in new:
            new = new[: new.index(end) + 1]
        samples.append(prompt + new)
    return samples


def sample_documents(model, tokenizer: PreTrainedTokenizerBase, sampling: Sampling) -> list[torch.Tensor]:
    """Samples of the source, each from a prompt cycled through `source_prompts`, at the temperatures in turn,
    until `sampling.tokens` (or `sampling.samples` samples); samples that loop are dropped (and a batch of loops
    only is no progress: after as many batches again as needed, what there is is returned). The caller's random
    state is left as it was."""
    prompts = source_prompts(tokenizer)
    documents, tokens, batch_index = [], 0, 0
    needed = max(-(-sampling.tokens // (sampling.batch_size * sampling.new_tokens // 2)), sampling.samples)

    def enough() -> bool:
        return len(documents) >= sampling.samples if sampling.samples else tokens >= sampling.tokens

    total = sampling.samples * sampling.new_tokens or sampling.tokens
    with torch.random.fork_rng(devices=[]), tqdm(total=total, desc="sampling the source", unit="tok") as bar:
        torch.manual_seed(sampling.seed)
        while not enough() and batch_index < 2 * needed + 2:
            first = batch_index * sampling.batch_size
            batch = [prompts[(first + row) % len(prompts)] for row in range(sampling.batch_size)]
            temperature = sampling.temperatures[batch_index % len(sampling.temperatures)]
            for sample in sample_batch(model, tokenizer, batch, temperature, sampling):
                if repeated_ngram_share(sample) <= sampling.max_repetition and not enough():
                    documents.append(torch.tensor(sample))
                    tokens += len(sample)
                    bar.update(len(sample))
            batch_index += 1
    if not documents:
        raise ValueError("Every sample of the source looped (repeated 4-grams above max_repetition): nothing to fit.")
    return documents


def sample_blocks(model, tokenizer: PreTrainedTokenizerBase, count: int, block_size: int, sampling: Sampling):
    """[count, block_size] blocks of the source's samples, one after another as a stream (fewer where the samples
    fall short)."""
    needed = count * block_size
    documents = sample_documents(model, tokenizer, dataclasses.replace(sampling, tokens=needed))
    stream = torch.cat(documents)
    usable = min(len(stream), needed) // block_size * block_size
    return stream[:usable].view(-1, block_size)
