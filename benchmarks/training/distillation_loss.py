"""The distillation loss and its backward on one recovery step's logits: torch's whole-batch formula against
egmla's chunked loss (`egmla.training.distillation_loss`), interleaved, medians.

    python benchmarks/training/distillation_loss.py                       # [2, 512, 49152]: SmolLM2's recovery step
    python benchmarks/training/distillation_loss.py --batch-size 4 --vocab 32000
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from egmla.training import distillation_loss


def whole_batch(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """The textbook formula: log-softmax of both, KL per token, over the whole batch at once."""
    log_student = F.log_softmax(student / temperature, dim=-1)
    log_teacher = F.log_softmax(teacher / temperature, dim=-1)
    return F.kl_div(log_student, log_teacher, log_target=True, reduction="none").sum(-1).mean() * temperature**2


def seconds(loss_function, shape: tuple[int, ...]) -> float:
    """Fresh logits (as every step has), the loss and its backward."""
    student = torch.randn(shape, requires_grad=True)
    teacher = torch.randn(shape)
    started = time.perf_counter()
    loss_function(student, teacher, 1.0).backward()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args()
    shape = (args.batch_size, args.length, args.vocab)
    samples = {"whole batch (torch kl_div)": [], "chunked (egmla)": []}
    functions = {"whole batch (torch kl_div)": whole_batch, "chunked (egmla)": distillation_loss}
    for _ in range(args.repetitions):
        for name, function in functions.items():
            samples[name].append(seconds(function, shape))
    baseline = statistics.median(samples["whole batch (torch kl_div)"])
    print(f"logits {list(shape)}: seconds for the loss and its backward (median of {args.repetitions})")
    for name, values in samples.items():
        print(f"  {name:28s} {statistics.median(values):6.2f} s ({statistics.median(values) / baseline:.2f}x)")


if __name__ == "__main__":
    main()
