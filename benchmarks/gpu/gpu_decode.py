"""GPU decode roofline (one prepared script, under 3 minutes on one H200): both Triton kernels against the
reference path and against an MHA decode of the same width (SDPA over a full K/V cache), with achieved bytes/s
and FLOP/s next to ceilings measured on the same GPU (a large copy, a large bf16 matmul).

    python benchmarks/gpu/gpu_decode.py                                  # on a CUDA machine
    TRITON_INTERPRET=1 python benchmarks/gpu/gpu_decode.py --smoke       # tiny shapes on the CPU: checks the script

Layer shapes are the paper's EG-MLA-kv64 (12 heads, nope/rope/value dims 64, latent 64, gate tables of 256),
bf16, for each decode path (`CASES`: gate on K/V, RoPE-exact latent, gate on the latent, gate off). "roofline" is the time the kernel would take at the measured ceilings: max(bytes / copy bandwidth,
FLOPs / matmul throughput), bytes being what it must read at least once (the cache and the weights); the
fraction is roofline / measured (the goal is >= 50%).
"""

import argparse
import statistics
import time

import torch

from egmla import EGMLAConfig, EGMLAForCausalLM
from egmla.kernels import KVDecodeInputs, KVDecodeWeights, LatentDecodeInputs, bool_mask, triton_decode
from egmla.modeling_egmla import EGMLAGateRows, absorbed_attention, build_step, expand_kv


def timed(function, repetitions: int, device: torch.device, warm_ups: int = 2) -> float:
    """Median seconds of `function()` after `warm_ups` calls."""
    for _ in range(warm_ups):
        function()
    samples = []
    for _ in range(repetitions):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1000)
        else:
            started = time.perf_counter()
            function()
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def ceilings(device: torch.device, smoke: bool) -> tuple[float, float]:
    """(bytes/s of a large device copy, FLOP/s of a large bf16 matmul), measured."""
    elements = 2**20 if smoke else 2**29  # 1 GiB of bf16
    source = torch.empty(elements, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    copy_seconds = timed(lambda: target.copy_(source), 3 if smoke else 20, device)
    size = 256 if smoke else 8192
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    matmul_seconds = timed(lambda: a @ b, 3 if smoke else 20, device)
    return 2 * source.numel() * 2 / copy_seconds, 2 * size**3 / matmul_seconds


# The decode paths: the gate on K/V, the RoPE-exact latent (gate on K/V, keys rotated), both re-expanding; the gate
# on the latent and plain MLA (gate off), both the absorbed MQA.
CASES = {
    "kv": {"gate_position": "kv"},
    "exact": {"gate_position": "kv", "rope_mode": "exact"},
    "latent": {"gate_position": "latent"},
    "mla": {"gate_embedding_dim": 0},
}


def attention_layer(case: str, device: torch.device):
    config = EGMLAConfig.from_preset("paper-egmla-kv64", num_hidden_layers=1, **CASES[case])
    module = EGMLAForCausalLM(config).model.layers[0].self_attn
    with torch.no_grad():
        if module.gate_embedding_proj is not None:  # a trained gate, not the identity it starts as
            module.gate_embedding_proj.weight.normal_(0.0, 0.02)
    return module.to(device=device, dtype=torch.bfloat16).eval()


def decode_case(module, batch_size: int, context: int, device: torch.device):
    """(kernel, reference, MHA) callables for one decode step over `context` cached tokens, the bytes the kernel
    must read at least once and its FLOPs."""
    heads, nope, rope, value_dim = module.num_heads, module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim
    rank, gate_dim = module.kv_lora_rank, module.config.gate_embedding_dim

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16)

    q_nope, q_rope = randn(batch_size, heads, 1, nope), randn(batch_size, heads, 1, rope)
    latent, rope_key = randn(batch_size, 1, context, rank), randn(batch_size, 1, context, module.rope_key_width)
    gate_rows = EGMLAGateRows(randn(batch_size * context, gate_dim), None, batch_size, context)  # one per position
    mask = bool_mask(None, batch_size, 1, context, device)
    key_rotary = None
    if module.rope_mode == "exact":  # cos, sin of the cached positions
        angles = torch.arange(context, device=device)[:, None] * torch.linspace(0, 1, rope // 2, device=device)
        cos, sin = (f(torch.cat([angles, angles], dim=-1)).expand(batch_size, -1, -1) for f in (torch.cos, torch.sin))
        key_rotary = (cos[:, None].to(torch.bfloat16), sin[:, None].to(torch.bfloat16))
    step = build_step(module, q_nope, q_rope, latent, rope_key, gate_rows, key_rotary, decoding=True)
    weight, layout = step.kv_weight, step.layout
    rebuilt = layout.rebuilt_key_dim + value_dim  # per head: the keys' rebuilt dims and the value
    if not layout.absorbs:
        gate_weight = step.gate_weight
        query = torch.cat([q_nope, q_rope], dim=-1)
        key_cos, key_sin = (key_rotary[0][:, 0], key_rotary[1][:, 0]) if key_rotary else (None, None)
        inputs = KVDecodeInputs(query, latent[:, 0], rope_key[:, 0], gate_rows.rows, None, key_cos, key_sin, mask)
        norm_weight, norm_eps = step.norm_weight, layout.norm_eps
        weights = KVDecodeWeights(weight, gate_weight, norm_weight, norm_eps, layout.scaling, nope, 1)

        def kernel():
            return triton_decode.decode_kv(inputs, weights)

        def reference():
            key, value = expand_kv(module, latent, rope_key, gate_rows, key_rotary)
            return torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=module.scaling)

        # The cache, the gate rows and the weights read once; expansion, gate and attention FLOPs.
        read = (latent.numel() + rope_key.numel() + gate_rows.rows.numel() + weight.numel() + gate_weight.numel()) * 2
        flops = 2 * batch_size * context * heads * (rebuilt * (rank + gate_dim) + nope + rope + value_dim)
    else:
        query_latent = torch.einsum("bhsd,hdr->bhsr", q_nope, weight[:, :nope])
        inputs = LatentDecodeInputs(query_latent, q_rope, latent[:, 0], rope_key[:, 0], mask)

        def kernel():
            return triton_decode.decode_latent(inputs, module.scaling)

        def reference():
            return absorbed_attention(step, None)

        read = (latent.numel() + rope_key.numel()) * 2
        flops = 2 * batch_size * heads * context * (rank + rope + rank)
    # MHA of the same width: every head caches its full key (nope + rope) and its value.
    mha_query = randn(batch_size, heads, 1, nope + rope)
    mha_key, mha_value = randn(batch_size, heads, context, nope + rope), randn(batch_size, heads, context, value_dim)

    def mha():
        return torch.nn.functional.scaled_dot_product_attention(mha_query, mha_key, mha_value)

    return kernel, reference, mha, read, flops


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repetitions", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on the CPU")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    # The smoke run checks the script, not its timings: one call of each (Triton's interpreter compiles nothing).
    contexts, batch_size, repetitions, warm_ups = (
        ([40], 2, 1, 0) if args.smoke else (args.contexts, args.batch_size, args.repetitions, 2)
    )
    bandwidth, throughput = ceilings(device, args.smoke)
    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (smoke)'}: ceilings "
          f"{bandwidth / 1e9:.0f} GB/s copy, {throughput / 1e12:.1f} TFLOP/s bf16 matmul")  # fmt: skip
    print(
        "| kernel | batch | context | ms | vs reference | vs MHA (SDPA, full cache) | GB/s | TFLOP/s | roofline % |"
        "\n|---|---|---|---|---|---|---|---|---|"
    )
    for case in CASES:
        module = attention_layer(case, device)
        for context in contexts:
            kernel, reference, mha, read, flops = decode_case(module, batch_size, context, device)
            kernel_s, reference_s, mha_s = (timed(f, repetitions, device, warm_ups) for f in (kernel, reference, mha))
            roofline = max(read / bandwidth, flops / throughput)
            print(
                f"| {case} | {batch_size} | {context} | {kernel_s * 1e3:.3f} | {reference_s / kernel_s:.2f}x "
                f"| {mha_s / kernel_s:.2f}x | {read / kernel_s / 1e9:.0f} | {flops / kernel_s / 1e12:.2f} "
                f"| {100 * roofline / kernel_s:.0f}% |"
            )


if __name__ == "__main__":
    main()
