"""Fused decode kernels: Triton (through its CPU interpreter) and the compiled CPU path against the reference."""

import copy
import importlib.util
import logging
import os

import pytest
import torch

from egmla import EGMLAForCausalLM, kernels
from egmla.kernels import dispatch, fused_torch
from egmla.kernels.interface import KVDecodeInputs, KVDecodeWeights, LatentDecodeInputs
from egmla.modeling_egmla import (
    LATENT_DECODE_VERSION,
    EGMLAGateRows,
    EGMLAStep,
    absorbed_attention,
    blocked_attention,
    build_step,
    eager_attention_forward,
    expand_kv,
    expanded_attention,
)
from tests.utils import FUSED, KERNEL, QK_NORM, tiny_config, tiny_model

# Only the tests that run Triton need it: the compiled and reference paths run without it.
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
BACKENDS = ["compiled", pytest.param("triton", marks=needs_triton)]

# context length, new tokens, rope key heads, gate width, gate norm, left padding of the first row
CASES = [
    pytest.param(37, 1, 1, 10, "rms", 0, id="odd-context"),
    pytest.param(1, 1, 1, 10, "none", 0, id="context-of-1"),
    pytest.param(29, 1, 2, 10, "rms", 6, id="left-padding"),
    pytest.param(21, 3, 2, 10, "none", 4, id="speculative-3"),
    pytest.param(45, 2, 1, 0, "none", 3, id="gate-off"),
]


def attention_module(
    gate_position: str, rope_key_heads: int, gate_dim: int, gate_norm: str, dtype=torch.float32, rope_mode="decoupled"
):
    torch.manual_seed(0)
    config = tiny_config(
        KERNEL,
        rope_key_heads=rope_key_heads,
        gate_embedding_dim=gate_dim,
        gate_position=gate_position,
        gate_norm=gate_norm,
        rope_mode=rope_mode,
    )
    module = EGMLAForCausalLM(config).model.layers[0].self_attn.eval()
    with torch.no_grad():
        if module.gate_embedding_proj is not None:  # a trained gate, not the identity it starts as
            module.gate_embedding_proj.weight.normal_(0.0, 0.2)
        if module.gate_norm is not None:
            module.gate_norm.weight.uniform_(0.5, 1.5)
    return module.to(dtype)


def decode_step(module, batch_size: int, key_length: int, query_length: int, padding: int, dtype=torch.float32):
    """Random rotated queries and cache contents for a decode step, built as the model builds it (gate rows one per
    position), and the bool mask [B, S, T]."""
    generator = torch.Generator().manual_seed(key_length)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    heads = module.num_heads
    q_nope, q_rope = randn(batch_size, heads, query_length, 16), randn(batch_size, heads, query_length, 8)
    latent = randn(batch_size, 1, key_length, 24)
    rope_key = randn(batch_size, 1, key_length, module.rope_key_heads * 8)
    gate_width = module.config.gate_embedding_dim
    gate_rows = None
    if gate_width:
        gate_rows = EGMLAGateRows(randn(batch_size * key_length, gate_width), None, batch_size, key_length)
    mask = kernels.bool_mask(None, batch_size, query_length, key_length, "cpu").clone()
    mask[0, :, :padding] = False  # the first row is left-padded
    return build_step(module, q_nope, q_rope, latent, rope_key, gate_rows=gate_rows, decoding=True), mask


def in_float32(step: EGMLAStep) -> EGMLAStep:
    """The step with every tensor (queries, cache contents, weights) in float32."""
    tensors = {name: value.float() for name, value in step._asdict().items() if isinstance(value, torch.Tensor)}
    rows = step.gate_rows
    rows = rows._replace(rows=rows.rows.float()) if rows is not None else None
    return step._replace(**tensors, gate_rows=rows)


def reference(module, step: EGMLAStep, mask: torch.Tensor) -> torch.Tensor:
    """The model's own (eager) decode path: the absorbed MQA where it is exact, else the re-expansion."""
    if module.absorbs:
        return absorbed_attention(step, mask[:, None])[0]
    key, value = expand_kv(module, step.latent, step.rope_key, step.gate_rows, step.key_rotary, step.key_scale)
    additive = torch.zeros(mask.shape, dtype=step.q_nope.dtype).masked_fill(~mask, torch.finfo(step.q_nope.dtype).min)
    query = torch.cat([step.q_nope, step.q_rope], dim=-1)
    return eager_attention_forward(module, query, key, value, additive[:, None], scaling=module.scaling)[0]


def relative_error(output: torch.Tensor, expected: torch.Tensor) -> float:
    return ((output.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize("gate_position", ["kv", "latent"])
@pytest.mark.parametrize(("key_length", "query_length", "rope_key_heads", "gate_dim", "gate_norm", "padding"), CASES)
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@needs_triton
def test_triton_kernels_equal_the_reference(
    gate_position, key_length, query_length, rope_key_heads, gate_dim, gate_norm, padding, dtype, tolerance
):
    module = attention_module(gate_position, rope_key_heads, gate_dim, gate_norm, dtype)
    step, mask = decode_step(module, 2, key_length, query_length, padding, dtype)
    # The reference runs in fp32 on the same (rounded) weights and inputs.
    expected = reference(copy.deepcopy(module).float(), in_float32(step), mask)
    output = kernels.fused_decode(step, mask[:, None], "triton")
    assert output.dtype == dtype and output.shape == expected.shape
    assert torch.isfinite(output).all()
    assert relative_error(output, expected) <= tolerance


@pytest.mark.parametrize("split_size", [16, 32, 64])
@needs_triton
def test_unwritten_outputs_fail_and_splits_merge(split_size):
    """The kernels write into NaN-filled buffers (an element no program writes stays NaN), and every split size,
    one split or several, merges to the same result."""
    module = attention_module("kv", 2, 10, "rms")
    step, mask = decode_step(module, 2, 45, 2, 5)
    inputs = KVDecodeInputs(
        torch.cat([step.q_nope, step.q_rope], dim=-1), step.latent[:, 0], step.rope_key[:, 0],
        step.gate_rows.rows, None, None, None, mask,
    )  # fmt: skip
    weights = KVDecodeWeights(
        step.kv_weight, step.gate_weight, step.norm_weight, step.layout.norm_eps, step.layout.scaling, 16, 2,
    )  # fmt: skip
    out = torch.full((2, 2, 4, 12), float("nan"))
    from egmla.kernels import triton_decode

    triton_decode.decode_kv(inputs, weights, split_size=split_size, block_t=16, out=out)
    assert torch.isfinite(out).all()
    assert relative_error(out, reference(module, step, mask)) <= 1e-4
    latent_inputs = LatentDecodeInputs(
        torch.randn(2, 4, 2, 24), torch.randn(2, 4, 2, 16), step.latent[:, 0], step.rope_key[:, 0], mask
    )
    out = torch.full((2, 4, 2, 24), float("nan"))
    triton_decode.decode_latent(latent_inputs, 0.2, split_size=split_size, block_t=16, out=out)
    assert torch.isfinite(out).all()
    assert relative_error(out, fused_torch.decode_latent(latent_inputs, 0.2)) <= 1e-4


@pytest.mark.parametrize("gate_position", ["kv", "latent"])
def test_compiled_path_in_bf16_equals_the_fp32_reference(gate_position):
    module = attention_module(gate_position, 2, 10, "rms", torch.bfloat16)
    step, mask = decode_step(module, 2, 37, 1, 3, torch.bfloat16)
    expected = reference(copy.deepcopy(module).float(), in_float32(step), mask)
    output = kernels.fused_decode(step, mask[:, None], "compiled")
    assert output is not None and output.dtype == torch.bfloat16, dispatch._compile_failed
    assert relative_error(output, expected) <= 1e-2


@pytest.mark.parametrize("gate_position", ["kv", "latent"])
def test_compiled_path_equals_the_reference(gate_position):
    module = attention_module(gate_position, 2, 10, "rms")
    for key_length in (9, 33):  # dynamic shapes: a growing context must not need a new graph per step
        step, mask = decode_step(module, 2, key_length, 1, 3)
        output = kernels.fused_decode(step, mask[:, None], "compiled")
        assert output is not None, dispatch._compile_failed
        assert relative_error(output, reference(module, step, mask)) <= 1e-4


@pytest.mark.parametrize(
    "vocabulary", [pytest.param(6, id="repeated-tokens"), pytest.param(1000, id="distinct-tokens")]
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gate_once_per_distinct_token_equals_the_reference(vocabulary, backend):
    """The model looks the gate rows up once per distinct token (rows [U, de] and the index of every position);
    both backends, and the reference, gather them per position."""
    from egmla.modeling_egmla import look_up_gate_rows

    module = attention_module("kv", 1, 10, "rms")
    generator = torch.Generator().manual_seed(vocabulary)
    table = torch.nn.Embedding(vocabulary, 10)
    torch.nn.init.normal_(table.weight, generator=generator)
    for key_length in (17, 40):
        step, mask = decode_step(module, 2, key_length, 1, 5)
        if vocabulary == 6:
            token_ids = torch.randint(0, vocabulary, (2, key_length), generator=generator)
        else:
            token_ids = torch.randperm(vocabulary, generator=generator)[: 2 * key_length].view(2, key_length)
        (gate_rows,) = look_up_gate_rows(torch.nn.ModuleList([table]), token_ids)
        if vocabulary == 6:  # 6 distinct tokens: one gate row each, gathered per position
            assert gate_rows.rows.shape == (6, 10) and torch.equal(gate_rows.rows[gate_rows.index], table(token_ids))
        else:  # no repeats: one row per position, no gather
            assert gate_rows.index is None and torch.equal(gate_rows.rows, table(token_ids).flatten(0, 1))
        step = step._replace(gate_rows=gate_rows)
        with torch.no_grad():
            expected = reference(module, step, mask)
            output = kernels.fused_decode(step, mask[:, None], backend)
        assert output is not None, dispatch._compile_failed
        assert relative_error(output, expected) <= 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("gate_position", "q_lora_rank"), [("kv", None), ("latent", 12)])
def test_generate_with_egmla_fused_gives_the_reference_tokens(monkeypatch, backend, gate_position, q_lora_rank):
    model = tiny_model(seed=1, base=FUSED, gate_std=0.3, gate_position=gate_position, q_lora_rank=q_lora_rank)
    # Few distinct tokens: the gate is computed once per distinct token and gathered.
    prompts = torch.randint(1, 8, (2, 9), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(prompts)
    prompts[0, :3], attention_mask[0, :3] = 0, 0  # left padding
    settings = {"attention_mask": attention_mask, "max_new_tokens": 8, "do_sample": False}
    model.set_attn_implementation("eager")
    expected = model.generate(prompts, **settings)
    steps, real_kernel = [], dispatch.kernel

    def recording_kernel(chosen, name):
        function = real_kernel(chosen, name)

        def run(inputs, *rest):
            steps.append((chosen, getattr(inputs, "gate_index", None) is not None))
            return function(inputs, *rest)

        return run

    monkeypatch.setattr(dispatch, "kernel", recording_kernel)
    model.set_attn_implementation(f"egmla_fused_{backend}")
    assert torch.equal(model.generate(prompts, **settings), expected)
    assert len(steps) == 2 * 7 and {chosen for chosen, _ in steps} == {backend}  # every decode step of every layer
    if gate_position == "kv":
        assert all(gathered for _, gathered in steps)  # the gate was computed per distinct token


def test_backend_choice_and_its_log_line(monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "KERNEL_OVERRIDE", None)
    assert kernels.choose_backend("auto", torch.device("cpu")) == "compiled"
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    assert kernels.choose_backend("auto", torch.device("cuda")) == "triton"
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    dispatch._logged.clear()
    with caplog.at_level(logging.WARNING, logger="egmla.kernels.dispatch"):
        assert kernels.choose_backend("auto", torch.device("cuda")) == "reference"
        assert kernels.choose_backend("auto", torch.device("cuda")) == "reference"
    assert [record.message for record in caplog.records] == [
        "egmla_fused: Triton is not installed, so decoding uses the reference path (pip install triton)."
    ]  # one line, not one per step
    with pytest.raises(ValueError, match="attn_implementation=triton, but Triton is not installed"):
        kernels.choose_backend("triton", torch.device("cpu"))
    monkeypatch.setattr(dispatch, "KERNEL_OVERRIDE", "reference")  # EGMLA_KERNEL, read once at import
    assert kernels.choose_backend("auto", torch.device("cpu")) == "reference"
    assert kernels.choose_backend("compiled", torch.device("cpu")) == "compiled"  # a named backend wins
    monkeypatch.setattr(dispatch, "KERNEL_OVERRIDE", "fast")
    with pytest.raises(ValueError, match="EGMLA_KERNEL must be one of"):
        kernels.choose_backend("auto", torch.device("cpu"))
    monkeypatch.setattr(dispatch, "KERNEL_OVERRIDE", "triton")
    with pytest.raises(ValueError, match="Triton is not installed"):
        kernels.choose_backend("auto", torch.device("cpu"))


def test_the_override_is_read_once_at_import():
    """EGMLA_KERNEL is a process-wide choice read when egmla is imported, not on every decode step."""
    import subprocess
    import sys

    code = (
        "import torch, egmla; from egmla.kernels import dispatch; "
        "print(dispatch.choose_backend('auto', torch.device('cpu')))"
    )
    env = {**os.environ, "EGMLA_KERNEL": "reference"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "reference"


def test_reference_backend_decodes_through_the_model_path(monkeypatch):
    """With the reference backend, egmla_fused decodes exactly as the eager model does."""
    monkeypatch.setattr(dispatch, "KERNEL_OVERRIDE", "reference")
    model = tiny_model(seed=1, base=FUSED, gate_std=0.3, gate_position="kv")
    prompts = torch.randint(1, 80, (1, 6), generator=torch.Generator().manual_seed(3))
    model.set_attn_implementation("eager")
    expected = model.generate(prompts, max_new_tokens=5, do_sample=False)
    model.set_attn_implementation("egmla_fused")
    assert torch.equal(model.generate(prompts, max_new_tokens=5, do_sample=False), expected)


def test_an_unknown_decode_contract_goes_to_the_reference_path(caplog):
    module = attention_module("kv", 1, 10, "rms")
    step, mask = decode_step(module, 1, 7, 1, 0)
    with caplog.at_level(logging.WARNING, logger="egmla.kernels.dispatch"):
        assert kernels.fused_decode(step._replace(version=LATENT_DECODE_VERSION + 1), mask, "compiled") is None
    assert f"decode contract is version {LATENT_DECODE_VERSION + 1}" in caplog.text


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("gate_position", "gate_dim", "gate_norm"), [("kv", 10, "rms"), ("latent", 10, "rms"), ("kv", 0, "none")]
)
def test_fused_paths_equal_the_reference_in_exact_rope_mode(backend, gate_position, gate_dim, gate_norm):
    """rope_mode="exact": both fused paths rebuild every key from the latent and rotate it at its cached position,
    as the reference does (each row at its own positions), one split or several."""
    module = attention_module(gate_position, 1, gate_dim, gate_norm, rope_mode="exact")
    rotary_emb = EGMLAForCausalLM(module.config).model.rotary_emb  # cos, sin at each row's own positions
    for key_length, query_length in ((9, 1), (45, 2)):  # dynamic shapes: a growing context must not recompile
        step, mask = decode_step(module, 2, key_length, query_length, 3)
        positions = torch.stack([torch.arange(key_length), torch.arange(key_length) + 5])
        cos, sin = rotary_emb(step.latent, positions)
        step = step._replace(rope_key=step.rope_key[..., :0], key_rotary=module.select_rotary(cos, sin))
        output = kernels.fused_decode(step, mask[:, None], backend)
        assert output is not None, dispatch._compile_failed
        assert relative_error(output, reference(module, step, mask)) <= 1e-4


@pytest.mark.parametrize("gate_position", ["kv", "latent"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_generate_in_exact_rope_mode_with_egmla_fused_gives_the_reference_tokens(gate_position, backend):
    model = tiny_model(seed=1, base=FUSED, gate_std=0.3, gate_position=gate_position, rope_key_heads=1,
                       rope_mode="exact")  # fmt: skip
    prompts = torch.randint(1, 8, (2, 9), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(prompts)
    prompts[0, :3], attention_mask[0, :3] = 0, 0  # left padding: the rows' positions differ
    settings = {"attention_mask": attention_mask, "max_new_tokens": 8, "do_sample": False}
    model.set_attn_implementation("eager")
    expected = model.generate(prompts, **settings)
    model.set_attn_implementation(f"egmla_fused_{backend}")
    assert torch.equal(model.generate(prompts, **settings), expected)


@needs_triton
def test_the_gpu_benchmark_script_runs(tmp_path):
    """benchmarks/gpu/gpu_decode.py is meant for a GPU; --smoke runs its whole path on tiny shapes in the
    interpreter."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "gpu_decode.py"
    result = subprocess.run(
        [sys.executable, str(script), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split("|")[1].strip() for line in result.stdout.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["kv", "exact", "latent", "mla"]  # a header, then one row per decode path


@needs_triton
def test_triton_leaves_steps_under_autograd_to_the_reference():
    module = attention_module("kv", 1, 10, "rms")
    step, mask = decode_step(module, 1, 7, 1, 0)
    step = step._replace(q_nope=step.q_nope.requires_grad_(True))
    assert kernels.fused_decode(step, mask[:, None], "triton") is None
    with torch.no_grad():
        assert kernels.fused_decode(step, mask[:, None], "triton") is not None


@needs_triton
def test_the_default_is_the_verified_torch_path_on_cuda_too_and_egmla_fused_is_opt_in(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EGMLAForCausalLM(tiny_config(FUSED)).config._attn_implementation == "sdpa"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA machine with Triton installed
    assert importlib.util.find_spec("triton") is not None
    assert EGMLAForCausalLM(tiny_config(FUSED)).config._attn_implementation == "sdpa"
    fused = EGMLAForCausalLM._from_config(tiny_config(FUSED), attn_implementation="egmla_fused")
    assert fused.config._attn_implementation == "egmla_fused"  # by name
    eager = EGMLAForCausalLM._from_config(tiny_config(FUSED), attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"  # an explicit choice wins


def test_gate_rows_take_int32_token_ids():
    from egmla.modeling_egmla import look_up_gate_rows

    token_ids = torch.tensor([[3, 5, 3, 3, 5, 3, 5, 5]], dtype=torch.int32)
    table = torch.nn.Embedding(8, 4)
    (gate_rows,) = look_up_gate_rows(torch.nn.ModuleList([table]), token_ids)
    assert gate_rows.rows.shape == (2, 4) and torch.equal(gate_rows.rows[gate_rows.index], table(token_ids))


@pytest.mark.parametrize("rope_key_heads", [1, 2])
@pytest.mark.parametrize(("gate_position", "gate_dim"), [("kv", 0), ("latent", 0), ("latent", 10)])
def test_the_absorbed_decode_equals_the_re_expansion_wherever_it_is_chosen(gate_position, gate_dim, rope_key_heads):
    """Gate off (either position) or on the latent, decoupled rope: decoding absorbs W^{UK} and attends over the
    shared latent, and gives what re-expanding every cached latent gives."""
    module = attention_module(gate_position, rope_key_heads, gate_dim, "rms")
    assert module.absorbs
    step, mask = decode_step(module, 2, 29, 3, 4)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)[:, None]
    layout = step.layout  # W^{UK} [H, dn, r] and W^{UV} transposed [H, r, dv], made with the step
    assert step.uk_weight.shape == (layout.num_heads, layout.qk_nope_head_dim, layout.kv_lora_rank)
    assert step.uv_weight.shape == (layout.num_heads, layout.kv_lora_rank, layout.v_head_dim)
    absorbed, _ = absorbed_attention(step, additive)
    expanded, _ = expanded_attention(module, step, additive)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)
    assert not attention_module("kv", rope_key_heads, 10, "rms").absorbs  # the gate on K/V sits after the cache
    assert not attention_module(gate_position, 1, gate_dim, "rms", rope_mode="exact").absorbs


@pytest.mark.parametrize(
    ("gate_position", "gate_dim", "rope_key_heads", "rope_mode", "gate_norm"),
    [
        ("kv", 10, 2, "decoupled", "rms"),  # the norm folded into the query, scores and output
        ("kv", 10, 1, "decoupled", "none"),
        ("kv", 10, 1, "exact", "rms"),
        ("latent", 10, 1, "exact", "rms"),
        ("kv", 0, 1, "exact", "rms"),
    ],
)
def test_the_blocked_re_expansion_equals_the_whole_one(gate_position, gate_dim, rope_key_heads, rope_mode, gate_norm):
    """The default re-expanding decode (`blocked_attention`: DECODE_BLOCK positions at a time, online softmax)
    gives what expanding the whole cache and one softmax give: several blocks and a partial one, left padding,
    several new tokens, one new token without a mask, gate rows one per position and one per distinct token."""
    from egmla.modeling_egmla import DECODE_BLOCK

    module = attention_module(gate_position, rope_key_heads, gate_dim, gate_norm, rope_mode=rope_mode)
    rotary_emb = EGMLAForCausalLM(module.config).model.rotary_emb
    for key_length, query_length, padding in ((2 * DECODE_BLOCK + 37, 3, 40), (DECODE_BLOCK + 5, 1, 0)):
        step, mask = decode_step(module, 2, key_length, query_length, padding)
        if rope_mode == "exact":
            cos, sin = rotary_emb(step.latent, torch.arange(key_length)[None].expand(2, -1))
            step = step._replace(rope_key=step.rope_key[..., :0], key_rotary=module.select_rotary(cos, sin))
        additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)[:, None]
        masks = [additive, mask[:, None]] + ([None] if padding == 0 else [])
        gate_forms = [step.gate_rows]
        if step.gate_rows is not None:  # 7 distinct tokens: a row each and an index per position
            rows = torch.randn(7, gate_dim, generator=torch.Generator().manual_seed(7))
            index = torch.randint(0, 7, (2, key_length), generator=torch.Generator().manual_seed(8))
            gate_forms.append(EGMLAGateRows(rows, index, 2, key_length))
        for gate_rows in gate_forms:
            gated = step._replace(gate_rows=gate_rows)
            expected, _ = expanded_attention(module, gated, additive)
            for attention_mask in masks:
                blocked, _ = blocked_attention(gated, attention_mask)
                torch.testing.assert_close(blocked, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("gate_position", "gate_dim", "values_absorbed"),
    [("latent", 10, True), ("kv", 0, True), ("kv", 10, False)],
)
def test_the_re_expansion_rebuilds_only_keys_where_no_gate_sits_on_the_values(
    monkeypatch, gate_position, gate_dim, values_absorbed
):
    """RoPE-exact keys with the gate off or on the latent: each block rebuilds only the keys, the weights sum the
    cached latents and W^{UV} follows once (equal to the whole expansion, above); the gate on K/V rebuilds both."""
    import egmla.modeling_egmla as modeling

    module = attention_module(gate_position, 1, gate_dim, "rms", rope_mode="exact")
    rotary_emb = EGMLAForCausalLM(module.config).model.rotary_emb
    step, mask = decode_step(module, 2, 40, 1, 3)
    cos, sin = rotary_emb(step.latent, torch.arange(40)[None].expand(2, -1))
    step = step._replace(rope_key=step.rope_key[..., :0], key_rotary=module.select_rotary(cos, sin))
    widths, rebuild = [], modeling.rebuild_block

    def recording(*args, **kwargs):
        kv = rebuild(*args, **kwargs)
        widths.append(kv.shape[-1])  # per head, what each block rebuilds
        return kv

    monkeypatch.setattr(modeling, "rebuild_block", recording)
    blocked, _ = blocked_attention(step, mask[:, None])
    expected, _ = expanded_attention(module, step, mask[:, None])
    torch.testing.assert_close(blocked, expected, rtol=1e-5, atol=1e-5)
    rebuilt = module.rebuilt_key_dim + (0 if values_absorbed else module.v_head_dim)
    assert widths and set(widths) == {rebuilt}


@pytest.mark.parametrize(("gate_position", "gate_dim"), [("kv", 10), ("latent", 10)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_fused_kernels_read_the_caches_rows_where_they_lie(gate_position, gate_dim, backend):
    """The latent and rope keys as the caches hand them: views of one storage of rows [latent ; rope key] with
    room to spare. Both backends read them in place and give what contiguous copies give."""
    module = attention_module(gate_position, 1, gate_dim, "rms")
    step, mask = decode_step(module, 2, 37, 1, 3)
    rank, width = step.latent.shape[-1], step.rope_key.shape[-1]
    storage = torch.full((2, 1, 48, rank + width), float("nan"))  # unwritten rows must never be read
    storage[:, :, :37, :rank], storage[:, :, :37, rank:] = step.latent, step.rope_key
    rows = step._replace(latent=storage[:, :, :37, :rank], rope_key=storage[:, :, :37, rank:])
    assert not rows.latent.is_contiguous()
    expected = kernels.fused_decode(step, mask[:, None], backend)
    torch.testing.assert_close(kernels.fused_decode(rows, mask[:, None], backend), expected)


def test_a_compiled_backend_asked_for_by_name_raises_its_error_and_only_the_automatic_choice_falls_back(
    monkeypatch, caplog
):
    def broken_compiler(*args):
        raise RuntimeError("the compiler broke")

    monkeypatch.setattr(dispatch, "run_step", broken_compiler)
    monkeypatch.setattr(dispatch, "_compile_failed", [])
    monkeypatch.setattr(dispatch, "_logged", set())
    monkeypatch.setattr(dispatch, "KERNEL_OVERRIDE", None)
    model = tiny_model(seed=1, base=FUSED, gate_position="latent")
    prompts = torch.randint(1, 80, (1, 6), generator=torch.Generator().manual_seed(3))
    model.set_attn_implementation("eager")
    expected = model.generate(prompts, max_new_tokens=3, do_sample=False)
    model.set_attn_implementation("egmla_fused_compiled")
    with pytest.raises(RuntimeError, match="torch.compile of the decode step failed.*the compiler broke"):
        model.generate(prompts, max_new_tokens=3, do_sample=False)
    model.set_attn_implementation("egmla_fused")
    with caplog.at_level(logging.WARNING, logger="egmla.kernels.dispatch"):
        assert torch.equal(model.generate(prompts, max_new_tokens=3, do_sample=False), expected)
    assert caplog.text.count("torch.compile failed") == 1  # said once, then the reference path without retrying


@pytest.mark.parametrize("gate_position", ["kv", "latent"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_fused_kernels_multiply_each_keys_norm_scale_as_the_reference(gate_position, backend):
    """qk_norm: each cached key's norm scale (one per key-norm head, here 2 for 4 query heads) multiplies its scores
    in the fused kernels as in the reference path, absorbed (gate on the latent) and rebuilding (gate on K/V)."""
    module = attention_module(gate_position, 2, 10, "rms")
    step, mask = decode_step(module, 2, 37, 2, 3)
    scales = torch.rand(2, 1, 37, 2, generator=torch.Generator().manual_seed(5)) + 0.5  # [B, 1, T, Hn]
    step = step._replace(key_scale=scales)
    expected = reference(module, step, mask)
    output = kernels.fused_decode(step, mask[:, None], backend)
    assert output is not None, dispatch._compile_failed
    assert relative_error(output, expected) <= 1e-4
    unscaled = reference(module, step._replace(key_scale=None), mask)
    assert relative_error(unscaled, expected) > 1e-2  # the scales matter


@pytest.mark.parametrize("gate_position", ["kv", "latent"])
def test_generate_of_a_qk_norm_model_with_egmla_fused_gives_the_reference_tokens(monkeypatch, gate_position):
    """A `qk_norm` model's decode steps run the fused kernels (no fallback) and give the reference path's tokens."""
    model = tiny_model(seed=1, base=FUSED, gate_position=gate_position, qk_norm=True, **QK_NORM)
    prompts = torch.randint(1, 80, (2, 6), generator=torch.Generator().manual_seed(3))
    model.set_attn_implementation("eager")
    expected = model.generate(prompts, max_new_tokens=5, do_sample=False)
    ran = []
    run_step = dispatch.run_step
    monkeypatch.setattr(dispatch, "run_step", lambda step, *args: ran.append(step.key_scale) or run_step(step, *args))
    model.set_attn_implementation("egmla_fused_compiled")
    assert torch.equal(model.generate(prompts, max_new_tokens=5, do_sample=False), expected)
    assert ran and all(scale is not None for scale in ran)
