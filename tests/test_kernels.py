"""Fused decode kernels: Triton (through its CPU interpreter) and the compiled CPU path against the reference."""

import logging
import os

import pytest
import torch

from egmla import EGMLAConfig, EGMLAForCausalLM, kernels
from egmla.kernels import fused_torch
from egmla.modeling_egmla import eager_attention_forward
from tests import conftest

triton_decode = pytest.importorskip("egmla.kernels.triton_decode", reason="Triton is not installed")

# (name, context length, new tokens, rope key heads, gate width, gate norm, left padding of the first row)
CASES = [
    ("odd-context", 37, 1, 1, 10, "rms", 0),
    ("context-of-1", 1, 1, 1, 10, "none", 0),
    ("left-padding", 29, 1, 2, 10, "rms", 6),
    ("speculative-3", 21, 3, 2, 10, "none", 4),
    ("gate-off", 45, 2, 1, 0, "none", 3),
]


def attention_module(gate_position: str, rope_key_heads: int, gate_dim: int, gate_norm: str, dtype=torch.float32):
    torch.manual_seed(0)
    config = EGMLAConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rope_key_heads=rope_key_heads,
        gate_embedding_dim=gate_dim,
        gate_position=gate_position,
        gate_norm=gate_norm,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    module = EGMLAForCausalLM(config).model.layers[0].self_attn.eval()
    with torch.no_grad():
        if module.gate_embedding_proj is not None:  # a trained gate, not the identity it starts as
            module.gate_embedding_proj.weight.normal_(0.0, 0.2)
        if module.gate_norm is not None:
            module.gate_norm.weight.uniform_(0.5, 1.5)
    return module.to(dtype)


def decode_inputs(module, batch_size: int, key_length: int, query_length: int, padding: int, dtype=torch.float32):
    """Random rotated queries and cache contents for a decode step, and the bool mask [B, S, T]."""
    generator = torch.Generator().manual_seed(key_length)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    heads = module.num_heads
    q_nope, q_rope = randn(batch_size, heads, query_length, 16), randn(batch_size, heads, query_length, 8)
    latent = randn(batch_size, 1, key_length, 24)
    rope_key = randn(batch_size, 1, key_length, module.rope_key_heads * 8)
    gate_width = module.config.gate_embedding_dim
    gate_embedding = randn(batch_size, key_length, gate_width) if gate_width else None
    mask = kernels.bool_mask(None, batch_size, query_length, key_length, "cpu").clone()
    mask[0, :, :padding] = False  # the first row is left-padded
    return q_nope, q_rope, latent, rope_key, gate_embedding, mask


def reference(module, q_nope, q_rope, latent, rope_key, gate_embedding, mask):
    """The model's own (eager) decode path: re-expansion for gate_position="kv", absorbed MQA for "latent"."""
    if module.gate_position == "latent":
        return module.absorbed_attention(q_nope, q_rope, latent, rope_key, mask[:, None])[0]
    key, value = module.expand_kv(latent, rope_key, gate_embedding)
    additive = torch.zeros(mask.shape, dtype=q_nope.dtype).masked_fill(~mask, torch.finfo(q_nope.dtype).min)
    query = torch.cat([q_nope, q_rope], dim=-1)
    return eager_attention_forward(module, query, key, value, additive[:, None], scaling=module.scaling)[0]


def relative_error(output: torch.Tensor, expected: torch.Tensor) -> float:
    return ((output.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize("gate_position", ["kv", "latent"])
@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_triton_kernels_equal_the_reference(monkeypatch, gate_position, case, dtype, tolerance):
    _, key_length, query_length, rope_key_heads, gate_dim, gate_norm, padding = case
    monkeypatch.setenv("EGMLA_KERNEL", "triton")
    module = attention_module(gate_position, rope_key_heads, gate_dim, gate_norm, dtype)
    inputs = decode_inputs(module, 2, key_length, query_length, padding, dtype)
    # The reference runs in fp32 on the same (rounded) weights and inputs.
    expected = reference(
        module.float(), *[t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
    )
    output = kernels.fused_decode(module.to(dtype), *inputs[:5], inputs[5][:, None])
    assert output.dtype == dtype and output.shape == expected.shape
    assert torch.isfinite(output).all()
    assert relative_error(output, expected) <= tolerance


@pytest.mark.parametrize("split_size", [16, 32, 64])
def test_unwritten_outputs_fail_and_splits_merge(split_size):
    """The kernels write into NaN-filled buffers (an element no program writes stays NaN), and every split size,
    one split or several, merges to the same result."""
    module = attention_module("kv", 2, 10, "rms")
    q_nope, q_rope, latent, rope_key, gate_embedding, mask = decode_inputs(module, 2, 45, 2, 5)
    arguments = (
        torch.cat([q_nope, q_rope], dim=-1),
        latent[:, 0],
        rope_key[:, 0],
        gate_embedding,
        module.kv_b_weight(like=latent),
        module.gate_embedding_proj.weight.view(4, 28, 10),
        module.gate_norm.weight,
        module.gate_norm.variance_epsilon,
        mask,
        module.scaling,
        16,
        2,
    )
    out = torch.full((2, 2, 4, 12), float("nan"))
    triton_decode.decode_kv(*arguments, split_size=split_size, block_t=16, out=out)
    assert torch.isfinite(out).all()
    assert relative_error(out, reference(module, q_nope, q_rope, latent, rope_key, gate_embedding, mask)) <= 1e-4
    query_latent = torch.randn(2, 4, 2, 24)
    query_rope = torch.randn(2, 4, 2, 16)
    out = torch.full((2, 4, 2, 24), float("nan"))
    triton_decode.decode_latent(
        query_latent, query_rope, latent[:, 0], rope_key[:, 0], mask, 0.2, split_size=split_size, block_t=16, out=out
    )
    assert torch.isfinite(out).all()
    expected = fused_torch.decode_latent(query_latent, query_rope, latent[:, 0], rope_key[:, 0], mask, 0.2)
    assert relative_error(out, expected) <= 1e-4


@pytest.mark.parametrize("gate_position", ["kv", "latent"])
def test_compiled_path_equals_the_reference(monkeypatch, gate_position):
    monkeypatch.setenv("EGMLA_KERNEL", "compiled")
    module = attention_module(gate_position, 2, 10, "rms")
    for key_length in (9, 33):  # dynamic shapes: a growing context must not need a new graph per step
        inputs = decode_inputs(module, 2, key_length, 1, 3)
        output = kernels.fused_decode(module, *inputs[:5], inputs[5][:, None])
        assert output is not None, kernels._compile_failed
        assert relative_error(output, reference(module, *inputs)) <= 1e-4


@pytest.mark.parametrize("vocabulary", [6, 1000], ids=["repeated-tokens", "distinct-tokens"])
def test_compiled_gate_once_per_distinct_token_equals_the_reference(monkeypatch, vocabulary):
    monkeypatch.setenv("EGMLA_KERNEL", "compiled")
    module = attention_module("kv", 1, 10, "rms")
    generator = torch.Generator().manual_seed(vocabulary)
    table = torch.randn(vocabulary, 10, generator=generator)
    for key_length in (17, 40):
        q_nope, q_rope, latent, rope_key, _, mask = decode_inputs(module, 2, key_length, 1, 5)
        if vocabulary == 6:
            token_ids = torch.randint(0, vocabulary, (2, key_length), generator=generator)
        else:
            token_ids = torch.randperm(vocabulary, generator=generator)[: 2 * key_length].view(2, key_length)
        gate_embedding = table[token_ids]  # [B, T, de]: what the model looks up for the context
        gate_rows, gate_index = kernels.distinct_gate_rows(gate_embedding, token_ids)
        if vocabulary == 6:  # 6 distinct tokens: one gate row each, gathered per position
            assert gate_rows.shape == (6, 10) and torch.equal(gate_rows[gate_index], gate_embedding)
        else:  # no repeats: one row per position, no gather
            assert gate_index is None and gate_rows.shape == (2 * key_length, 10)
        inputs = (q_nope, q_rope, latent, rope_key, gate_embedding)
        output = kernels.fused_decode(module, *inputs, mask[:, None], token_ids=token_ids)
        assert output is not None, kernels._compile_failed
        assert relative_error(output, reference(module, *inputs, mask)) <= 1e-4


def tiny_config(gate_position: str, q_lora_rank: int | None) -> EGMLAConfig:
    return conftest.tiny_config(
        vocab_size=80,
        hidden_size=32,
        intermediate_size=48,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        v_head_dim=8,
        rope_key_heads=2,
        gate_embedding_dim=8,
        gate_position=gate_position,
        max_position_embeddings=128,
    )


def tiny_model(gate_position: str, q_lora_rank: int | None) -> EGMLAForCausalLM:
    torch.manual_seed(1)
    config = tiny_config(gate_position, q_lora_rank)
    model = EGMLAForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.gate_embedding_proj.weight.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("backend", ["triton", "compiled"])
@pytest.mark.parametrize(("gate_position", "q_lora_rank"), [("kv", None), ("latent", 12)])
def test_generate_with_egmla_fused_gives_the_reference_tokens(monkeypatch, backend, gate_position, q_lora_rank):
    monkeypatch.setenv("EGMLA_KERNEL", backend)
    model = tiny_model(gate_position, q_lora_rank)
    # Few distinct tokens: the compiled path computes the gate once per distinct token and gathers it.
    prompts = torch.randint(1, 8, (2, 9), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(prompts)
    prompts[0, :3], attention_mask[0, :3] = 0, 0  # left padding
    settings = {"attention_mask": attention_mask, "max_new_tokens": 8, "do_sample": False}
    model.set_attn_implementation("eager")
    expected = model.generate(prompts, **settings)
    calls = []
    monkeypatch.setattr(
        kernels, "choose_backend", lambda device, chosen=kernels.choose_backend: calls.append(1) or chosen(device)
    )
    gathered, distinct_gate_rows = [], kernels.distinct_gate_rows

    def recording_distinct_gate_rows(*arguments):
        rows, index = distinct_gate_rows(*arguments)
        gathered.append(index is not None)
        return rows, index

    monkeypatch.setattr(kernels, "distinct_gate_rows", recording_distinct_gate_rows)
    model.set_attn_implementation("egmla_fused")
    assert torch.equal(model.generate(prompts, **settings), expected)
    assert len(calls) == 2 * 7  # every decode step of every layer went through the fused path
    if backend == "compiled" and gate_position == "kv":
        assert gathered and all(gathered)  # the gate was computed per distinct token


def test_backend_choice_and_its_log_line(monkeypatch, caplog):
    monkeypatch.delenv("EGMLA_KERNEL", raising=False)
    assert kernels.choose_backend(torch.device("cpu")) == "compiled"
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    assert kernels.choose_backend(torch.device("cuda")) == "triton"
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    kernels._logged.clear()
    with caplog.at_level(logging.WARNING, logger="egmla.kernels"):
        assert kernels.choose_backend(torch.device("cuda")) == "reference"
        assert kernels.choose_backend(torch.device("cuda")) == "reference"
    assert [record.message for record in caplog.records] == [
        "egmla_fused: Triton is not installed, so decoding uses the reference path (pip install triton)."
    ]  # one line, not one per step
    monkeypatch.setenv("EGMLA_KERNEL", "reference")
    assert kernels.choose_backend(torch.device("cpu")) == "reference"
    monkeypatch.setenv("EGMLA_KERNEL", "fast")
    with pytest.raises(ValueError, match="EGMLA_KERNEL must be one of"):
        kernels.choose_backend(torch.device("cpu"))
    monkeypatch.setenv("EGMLA_KERNEL", "triton")
    with pytest.raises(ValueError, match="Triton is not installed"):
        kernels.choose_backend(torch.device("cpu"))


def test_reference_backend_decodes_through_the_model_path(monkeypatch):
    """EGMLA_KERNEL=reference: egmla_fused decodes exactly as the eager model does."""
    monkeypatch.setenv("EGMLA_KERNEL", "reference")
    model = tiny_model("kv", None)
    prompts = torch.randint(1, 80, (1, 6), generator=torch.Generator().manual_seed(3))
    model.set_attn_implementation("eager")
    expected = model.generate(prompts, max_new_tokens=5, do_sample=False)
    model.set_attn_implementation("egmla_fused")
    assert torch.equal(model.generate(prompts, max_new_tokens=5, do_sample=False), expected)


def test_the_gpu_benchmark_script_runs(tmp_path):
    """benchmarks/gpu_decode.py is meant for a GPU; --smoke runs its whole path on tiny shapes in the interpreter."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_decode.py"
    result = subprocess.run(
        [sys.executable, str(script), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| kv |") or line.startswith("| latent |")]
    assert len(rows) == 2


def test_triton_leaves_steps_under_autograd_to_the_reference(monkeypatch):
    monkeypatch.setenv("EGMLA_KERNEL", "triton")
    module = attention_module("kv", 1, 10, "rms")
    q_nope, q_rope, latent, rope_key, gate_embedding, mask = decode_inputs(module, 1, 7, 1, 0)
    q_nope.requires_grad_(True)
    assert kernels.fused_decode(module, q_nope, q_rope, latent, rope_key, gate_embedding, mask[:, None]) is None
    with torch.no_grad():
        assert kernels.fused_decode(module, q_nope, q_rope, latent, rope_key, gate_embedding, mask[:, None]) is not None


def test_egmla_fused_is_the_default_when_cuda_and_triton_are_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EGMLAForCausalLM(tiny_config("kv", None)).config._attn_implementation == "sdpa"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EGMLAForCausalLM(tiny_config("kv", None)).config._attn_implementation == "egmla_fused"
    eager = EGMLAForCausalLM._from_config(tiny_config("kv", None), attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"  # an explicit choice wins


def test_distinct_gate_rows_takes_int32_token_ids():
    token_ids = torch.tensor([[3, 5, 3, 3, 5, 3, 5, 5]], dtype=torch.int32)
    gate_embedding = torch.randn(8, 4)[token_ids]
    rows, index = kernels.distinct_gate_rows(gate_embedding, token_ids)
    assert rows.shape == (2, 4) and torch.equal(rows[index], gate_embedding)
