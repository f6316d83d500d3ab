"""What a whole-model conversion adds to memory beside its source, checked before the long stages: the student (about
the source's size) and, when the recovery trains every parameter, its gradients and Adam's two moments. Activations
and logits come on top, so this is a floor: a conversion that exceeds it is warned before it runs for an hour and
then runs out of memory."""

import torch
from accelerate.utils import get_max_memory
from transformers import PreTrainedModel

from ..training import FinetuneSettings

# The student's weights, and with a full recovery their gradients and Adam's first and second moments.
STUDENT_COPIES = 1
FULL_TRAINING_COPIES = 4


def free_memory(device: torch.device) -> int | None:
    """Bytes free on `device` now (host memory for the CPU and MPS), as accelerate counts them; None if unknown."""
    memory = get_max_memory()
    key = device.type if device.type in ("cpu", "mps") else (device.index or 0)
    return memory.get(key)


def memory_warning(teacher: PreTrainedModel, finetune: FinetuneSettings | None) -> str | None:
    """A warning when the student and its recovery's training state will not fit in what is free on the source's
    device (the source already loaded there); None when they will or when the free memory is unknown."""
    source_bytes = teacher.get_memory_footprint(return_buffers=False)
    trains_all = finetune is not None and not finetune.lora
    needed = source_bytes * (FULL_TRAINING_COPIES if trains_all else STUDENT_COPIES)
    free = free_memory(teacher.device)
    if free is None or needed <= free:
        return None
    what = "the student, its gradients and Adam's two moments" if trains_all else "the student"
    return (
        f"warning: this conversion needs at least {needed / 1e9:.1f} GB more on {teacher.device} ({what}, beside the "
        f"{source_bytes / 1e9:.1f} GB source), and {free / 1e9:.1f} GB are free: it may run out of memory. "
        "--dtype bfloat16 halves it, --lora trains adapters instead of every weight, --stream holds one layer at a "
        "time (without the recovery)."
    )
