"""Where a decode step of EG-MLA-kv64 with the gate on K/V spends its time on this CPU: each part of one layer's
re-expansion timed alone at the step's shapes, times the layers, against the whole step (`egmla bench decode`'s
default path) and against the arithmetic at a measured matmul rate.

    python benchmarks/decode/decode_breakdown.py                     # batch 8, context 2048, random ids (the bench's)
    python benchmarks/decode/decode_breakdown.py --batch-size 1 --context 512 --distinct 200

Random ids make every cached token distinct, so the gate is computed once per position (the worst case); text
repeats its tokens (2048 TinyStories tokens hold 434 distinct ones), which `--distinct` stands in for.
"""

import argparse
import statistics
import time

import torch

from egmla.bench.models import build, paper_dims
from egmla.measure import decode_state
from egmla.modeling_egmla import gate_norm_scale, kv_weights


def median_ms(function, repetitions: int = 5) -> float:
    function()
    samples = []
    for _ in range(repetitions):
        started = time.perf_counter()
        function()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--distinct", type=int, default=None, help="distinct cached tokens (default: all)")
    args = parser.parse_args()
    batch, context = args.batch_size, args.context
    model = build("egmla-kv64", paper_dims(), max_positions=context + 16)
    config, layers = model.config, model.config.num_hidden_layers
    heads, rank, gate_dim = config.num_attention_heads, config.kv_lora_rank, config.gate_embedding_dim
    width = heads * (config.qk_nope_head_dim + config.v_head_dim)  # the re-expanded K/V per position
    positions, distinct = batch * context, min(args.distinct or batch * context, batch * context)
    attention = model.model.layers[0].self_attn
    latent, rows = torch.randn(batch, context, rank), torch.randn(distinct, gate_dim)
    index = torch.randint(0, distinct, (positions,))
    kv_weight, _ = kv_weights(attention, like=latent)  # W^{UKV} [Hkv, dn+dv, r]
    expanded = torch.randn(batch, heads, context, width // heads)  # per head, as the blocked decode makes it
    gate_values = torch.randn(distinct, width)
    query = torch.randn(batch, heads, 1, config.qk_nope_head_dim)
    probs = torch.randn(batch, heads, 1, context)
    parts = {
        "expand the latent (W^{UKV}, per head)": lambda: torch.einsum("btr,hcr->bhtc", latent, kv_weight),
        "gate product (W^{UE} on the rows)": lambda: attention.gate_embedding_proj(rows),
        "gate gather and multiply": lambda: (
            expanded * gate_values.index_select(0, index).view(batch, context, heads, -1).transpose(1, 2)
        ),
        "gate norm scale (one pass; its weight folded)": lambda: gate_norm_scale(expanded, attention.layout.norm_eps),
        "attention products (q.k, p.v)": lambda: (
            torch.matmul(query, expanded[..., : config.qk_nope_head_dim].mT),
            torch.matmul(probs, expanded[..., config.qk_nope_head_dim :]),
        ),
    }
    parts_ms = {name: layers * median_ms(function) for name, function in parts.items()}
    state = decode_state(model, "dynamic", batch, context)
    if args.distinct:  # the cached ids drawn from `distinct` tokens
        state.cache.layers[0].token_ids = torch.randint(0, distinct, (batch, context))
    step_ms = median_ms(state.step, 3)
    size = 2048
    a, b = torch.randn(size, size), torch.randn(size, size)
    rate = 2 * size**3 / (median_ms(lambda: a @ b) / 1000)
    flops = layers * 2 * (positions * rank * width + distinct * gate_dim * width)
    # Every step reads every weight once (the embedding and gate tables only by the looked-up rows; a tied LM head in
    # full): the floor at batch 1.
    read = {
        id(p): p
        for n, p in model.named_parameters(remove_duplicate=False)
        if "gate_embeddings" not in n and "embed_tokens" not in n
    }
    weight_bytes = sum(p.numel() * p.element_size() for p in read.values())
    source = torch.randn(2**26)  # 256 MiB
    target = torch.empty_like(source)
    bandwidth = 2 * source.numel() * 4 / (median_ms(lambda: target.copy_(source)) / 1000)
    print(f"EG-MLA-kv64, gate on K/V, batch {batch}, context {context}, {distinct} distinct cached tokens, "
          f"{layers} layers, {torch.get_num_threads()} threads")  # fmt: skip
    print("| part of the step (all layers) | ms | share of the step |\n|---|---|---|")
    for name, value_ms in parts_ms.items():
        print(f"| {name} | {value_ms:.1f} | {value_ms / step_ms:.0%} |")
    print(f"| the whole decode step (default path) | {step_ms:.1f} | 100% |")
    print(
        f"\nexpansion + gate arithmetic: {flops / 1e9:.1f} GFLOP per step; at this CPU's measured fp32 matmul rate "
        f"({rate / 1e9:.0f} GFLOP/s, {size}^3) that alone takes {flops / rate * 1000:.0f} ms"
    )
    print(
        f"reading the {weight_bytes / 2**20:.0f} MiB of weights once per step at this CPU's measured copy bandwidth "
        f"({bandwidth / 1e9:.1f} GB/s) takes {weight_bytes / bandwidth * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
