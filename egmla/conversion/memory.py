"""What a whole-model conversion needs in memory, counted before its long stages: the source and the student, the
recovery's training state (gradients and Adam's two moments when every weight trains) and the largest stage's
activations (the recovery's logits and saved activations, or the scoring of the source's samples, whose logits span
the vocabulary). A conversion that would not fit is refused before it runs for an hour and then runs out of memory,
unless `--force`."""

from dataclasses import dataclass

import torch
from accelerate.utils import get_max_memory
from transformers import PreTrainedModel

GB = 1e9
RUNTIME_BYTES = int(1.0 * GB)  # Python, torch, transformers and the tokenizer, resident before any model
# The process's allocator keeps freed blocks: what peaks is the live tensors and a share more.
ALLOCATOR_OVERHEAD = 1.15
# Per token, the values a decoder layer saves for its backward (counted on student layers with
# `torch.autograd.graph.saved_tensors_hooks`, docs/results.md "The memory check against the measured peak"): the
# residual stream and its norms' statistics in float32 (autocast keeps them there), the linear layers' inputs and the
# attention's heads in the forward dtype (in units of the hidden size), the MLP's gate, up, activation and product (of
# the intermediate size). CPU SDPA keeps no attention weights, only their log-sum-exp.
SAVED_HIDDEN_FLOAT32, SAVED_HIDDEN, SAVED_INTERMEDIATE = 6, 8, 4
# The distillation's logits per token: the student's and the teacher's (in the forward dtype), the gradient and its
# scaled copy (float32).
LOGIT_COPIES_FLOAT32 = 2
# Scoring the source's samples: two models' float32 logits, their log-softmaxes and three temporaries of the KL.
SAMPLE_SCORING_COPIES = 7
SAMPLE_SCORING_BATCH = 4


@dataclass(frozen=True)
class MemoryShape:
    """What the estimate reads of a job: the recovery's tokens per micro-batch and whether it trains every weight,
    whether forward passes run under bf16 autocast, and the longest batch of samples scored."""

    recovery_batch: int  # sequences per micro-batch; 0 without a recovery
    recovery_block: int  # tokens per sequence
    full_training: bool
    autocast_bf16: bool
    sample_tokens: int  # the held-aside samples' longest length (0: none)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes, by what holds them; `peak` is what the process's resident memory is expected to reach."""

    runtime: int
    source: int
    student: int
    training: int
    activations: int

    @property
    def peak(self) -> int:
        live = self.source + self.student + self.training + self.activations
        return self.runtime + int(ALLOCATOR_OVERHEAD * live)


def saved_bytes_per_token(config, autocast_bf16: bool) -> int:
    """What one decoder layer saves for its backward per token of a training batch."""
    forward_bytes = 2 if autocast_bf16 else 4
    hidden, intermediate = config.hidden_size, config.intermediate_size
    return (
        SAVED_HIDDEN_FLOAT32 * 4 * hidden + (SAVED_HIDDEN * hidden + SAVED_INTERMEDIATE * intermediate) * forward_bytes
    )


def activation_bytes(config, shape: MemoryShape) -> int:
    """The largest stage's activations: the recovery's (saved per layer, and the logits) or the samples' scoring."""
    vocab, layers = config.vocab_size, config.num_hidden_layers
    scoring = SAMPLE_SCORING_COPIES * 4 * SAMPLE_SCORING_BATCH * shape.sample_tokens * vocab
    tokens = shape.recovery_batch * shape.recovery_block
    if not tokens:
        return scoring
    forward_bytes = 2 if shape.autocast_bf16 else 4
    saved = layers * tokens * saved_bytes_per_token(config, shape.autocast_bf16)
    logits = tokens * vocab * (2 * forward_bytes + 4 * LOGIT_COPIES_FLOAT32)
    return max(scoring, saved + logits)


def estimate_memory(source: PreTrainedModel, shape: MemoryShape) -> MemoryEstimate:
    """The conversion's memory on the source's device, from the source's footprint and config (the student is about
    the source's size: the attention shrinks, the embeddings and MLPs stay)."""
    source_bytes = source.get_memory_footprint(return_buffers=False)
    training = 3 * source_bytes if shape.full_training else 0  # gradients and Adam's two moments
    activations = activation_bytes(source.config, shape)
    return MemoryEstimate(RUNTIME_BYTES, source_bytes, source_bytes, training, activations)


def free_memory(device: torch.device) -> int | None:
    """Bytes free on `device` now (host memory for the CPU and MPS), as accelerate counts them; None if unknown."""
    memory = get_max_memory()
    key = device.type if device.type in ("cpu", "mps") else (device.index or 0)
    return memory.get(key)


def check_memory(source: PreTrainedModel, shape: MemoryShape, force: bool = False) -> MemoryEstimate:
    """The estimate, or a ValueError naming what would shrink it when what comes after the loaded source does not
    fit in what is free on its device (`force`: a warning instead)."""
    estimate = estimate_memory(source, shape)
    free = free_memory(source.device)
    more = estimate.peak - estimate.runtime - estimate.source  # the source is loaded already
    if free is None or more <= free:
        return estimate
    message = (
        f"this conversion needs about {more / GB:.1f} GB more on {source.device} (the student "
        f"{estimate.student / GB:.1f}, training state {estimate.training / GB:.1f}, activations "
        f"{estimate.activations / GB:.1f}; peak about {estimate.peak / GB:.1f} GB), and {free / GB:.1f} GB are free. "
        "--dtype bfloat16 halves the weights, --lora trains adapters instead of every weight, --stream holds one "
        "layer at a time (without the recovery); --force runs it anyway."
    )
    if not force:
        raise ValueError(message)
    print(f"warning: {message}")
    return estimate
