"""The one prepared GPU check: kernels, decode, conversion and the paper's claim, in about 8 minutes on one H200.

    python benchmarks/gpu/gpu_check.py --out benchmarks/results/gpu_check --text TEXT       # on a CUDA machine
    python benchmarks/gpu/gpu_check.py --tiny --out /tmp/gpu-check                          # tiny shapes on the CPU

Four sections, each bounded by its own minutes (the last by what --minutes leaves); a row that fails records its error and the check goes on, and
gpu_check.json and gpu_check.md are rewritten under --out after every section (a run cut short keeps what it did):
1. decode errors: every decode path (the expanded reference in the dtype, absorbed, blocked, the Triton latent and
   K/V kernels, compiled) on 1-layer random models of the paper's, a converted SmolLM2's and a converted 8B's shape,
   fp32 and bf16, against the uncached float32 forward of the same (dtype-rounded) weights: max logit error;
2. decode speed: random-weight Llamas of the 1B and 8B shapes against their conversion's shape (closed form, the
   defaults' split: one shared rope key of head_dim / 4 pairs, a 68.75% cut, the gate off; random weights, since a
   step costs the same whatever they hold) at (1, 2048), (32, 8192), (128, 8192) in bf16, each on its default path
   and compiled over a static cache, interleaved; bytes read per step against the card's measured copy rate;
3. the paper's figure: from-scratch training of MLA with a large latent, MLA with a small one and EG-MLA with the
   same small latent (gate on K/V as the paper, and on the latent), --seeds seeds each, the same steps each (as many
   as fit in --figure-minutes), on --text: held-out loss and KV bytes per token, mean and spread over seeds;
4. conversion: `egmla convert` of a random-weight 1B-shaped Llama on the device in bf16 with the defaults (recovery
   capped by --recovery-minutes), on --text: seconds by stage and peak GPU memory; stopped at --minutes.
`--tiny` shrinks every shape and budget so that the suite runs the whole check on the CPU in seconds.
"""

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM

# conversion/conversion_scale.py, the benchmark that writes random checkpoints
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "conversion"))
from conversion_scale import SHAPES, make_source  # noqa: E402

from egmla import EGMLAConfig, EGMLAForCausalLM, cache_nbytes  # noqa: E402
from egmla.bench.train import TrainBench, model_config  # noqa: E402
from egmla.conversion.convert import ConversionOptions, ConversionPlan, resolve_budget, student_config  # noqa: E402
from egmla.data import EXCERPT, TOKENIZER  # noqa: E402
from egmla.measure import decode_state, median_ms  # noqa: E402
from egmla.text import loss_and_accuracy, read_documents, split_documents, token_blocks  # noqa: E402
from egmla.training import FinetuneSettings, finetune  # noqa: E402

KV_CUT = 0.6875
# Decode paths by attention implementation; the eager and SDPA names take the model's own decode paths.
PATHS = ("eager", "sdpa", "egmla_fused_triton", "egmla_fused_compiled")
# The gate forms of the error check: on K/V (re-expanding, the paper's), RoPE-exact keys, on the latent, off.
GATE_CASES = {
    "kv": {"gate_position": "kv"},
    "exact": {"gate_position": "kv", "rope_mode": "exact"},
    "latent": {"gate_position": "latent"},
    "off": {"gate_embedding_dim": 0},
}
TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}  # max logit error / max |logit|, or twice the dtype's own eager


@dataclass
class Check:
    out: Path
    tiny: bool = False
    device: str = "cuda"
    text: Path = EXCERPT  # fitting and training text (documents separated by <|endoftext|>)
    minutes: float = 8.0  # the whole check: the conversion, last, is stopped at this
    error_minutes: float = 1.0
    decode_minutes: float = 2.0
    figure_minutes: float = 2.5
    recovery_minutes: float = 0.5
    seeds: int = 3

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ceilings(check: Check) -> dict:
    """The device's copy rate (bytes read and written per second) and bf16 matmul rate, measured."""
    device, elements, size = check.torch_device, 2**20 if check.tiny else 2**29, 256 if check.tiny else 8192
    source = torch.empty(elements, dtype=torch.bfloat16, device=device)
    target, a = torch.empty_like(source), torch.randn(size, size, dtype=torch.bfloat16, device=device)

    def seconds(function: Callable, repetitions: int = 10) -> float:
        function()
        synchronize(device)
        started = time.perf_counter()
        for _ in range(repetitions):
            function()
        synchronize(device)
        return (time.perf_counter() - started) / repetitions

    copy_rate = 2 * source.nbytes / seconds(lambda: target.copy_(source))
    return {"copy_bytes_per_s": copy_rate, "bf16_matmul_flops": 2 * size**3 / seconds(lambda: a @ a)}


# ----------------------------------------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------------------------------------


def llama_config(shape: str, layers: int | None = None, vocab_size: int | None = None) -> LlamaConfig:
    hidden, depth, heads, key_heads, mlp, vocab, tied = SHAPES[shape]
    return LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers or depth, num_attention_heads=heads,
        num_key_value_heads=key_heads, intermediate_size=mlp, vocab_size=vocab_size or vocab,
        tie_word_embeddings=tied, max_position_embeddings=8192 + 64, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )  # fmt: skip


def converted_config(source: LlamaConfig, **gate) -> EGMLAConfig:
    """The EG-MLA shape a closed-form conversion gives `source` with the defaults' split (one shared rope key of
    head_dim / 4 pairs at a 68.75% cut), the gate as given (off by default, as conversions are)."""
    options = ConversionOptions(kv_cut=KV_CUT, rope_split="shared", **{"gate_embedding_dim": 0, **gate})
    with torch.device("meta"):  # the source's modules only for their rope and bias settings: no weights
        teacher = LlamaForCausalLM(source)
    return student_config(teacher, ConversionPlan(options, resolve_budget(source, options)))


def error_shapes(tiny: bool) -> dict[str, Callable[[dict], EGMLAConfig]]:
    """name -> (gate case -> a 1-layer config of that shape) for the error check."""
    if tiny:
        paper = {"hidden_size": 64, "num_attention_heads": 4, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
                 "v_head_dim": 16, "kv_lora_rank": 16, "gate_embedding_dim": 16, "intermediate_size": 96}  # fmt: skip
        sources = {"tiny-converted": "tiny"}
    else:
        paper, sources = {}, {"smollm2-converted": "smollm2-135m", "llama-8b-converted": "llama-3.1-8b"}
    shapes = {
        "paper-egmla-kv64": lambda case: EGMLAConfig.from_preset(
            "paper-egmla-kv64", num_hidden_layers=1, vocab_size=512, bos_token_id=1, eos_token_id=2, **{**paper, **case}
        )
    }
    for name, source in sources.items():
        shapes[name] = lambda case, source=source: converted_config(
            llama_config(source, layers=1, vocab_size=512), **{"gate_embedding_dim": 64, **case}
        )
    return shapes


def random_model(config, dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A random model built on the device in `dtype`; a gate (which starts as the identity) drawn at random."""
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = (EGMLAForCausalLM if isinstance(config, EGMLAConfig) else LlamaForCausalLM)(config)
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "gate_embedding_proj", None) is not None:
                module.gate_embedding_proj.weight.normal_(0.0, 0.02)
    return model.eval()


# ----------------------------------------------------------------------------------------------------------------
# 1. Decode errors
# ----------------------------------------------------------------------------------------------------------------


def path_name(path: str, absorbs: bool) -> str:
    names = {
        "eager": "absorbed, batched products" if absorbs else "expanded reference (eager)",
        "sdpa": "absorbed, SDPA over cached rows" if absorbs else "blocked re-expansion",
        "egmla_fused_triton": "Triton latent kernel" if absorbs else "Triton K/V kernel",
        "egmla_fused_compiled": "compiled (torch.compile of fused_torch)",
    }
    return names[path]


@torch.no_grad()
def case_errors(config: EGMLAConfig, dtype: torch.dtype, check: Check, deadline: float) -> list[dict]:
    """One shape and gate case in one dtype: each path's decode step against the uncached float32 forward."""
    device = check.torch_device
    batch_size, context = (2, 37) if check.tiny else (2, 1024)
    model = random_model(config, dtype, device)
    reference_model = random_model(config, dtype, device).float()  # the same dtype-rounded weights, in fp32
    reference_model.set_attn_implementation("eager")
    ids = torch.randint(3, config.vocab_size, (batch_size, context + 1), device=device)
    reference = reference_model(ids).logits[:, -1].float()  # uncached: the expanded reference over every position
    del reference_model
    cache = DynamicCache(config=model.config)
    model.set_attn_implementation("sdpa")
    model(ids[:, :context], cache=cache, use_cache=True)
    absorbs = model.model.layers[0].self_attn.absorbs
    rows = []
    for path in PATHS:
        row = {"path": path_name(path, absorbs), "implementation": path}
        if path == "egmla_fused_compiled" and time.perf_counter() > deadline:
            rows.append({**row, "skipped": "the section's minutes were spent"})
            continue
        try:
            model.set_attn_implementation(path)
            logits = model(ids[:, context:], cache=cache, use_cache=True).logits[:, -1].float()
            cache.crop(-1)
            error = (logits - reference).abs().max().item()
            rows.append({**row, "max_error": error, "relative_error": error / reference.abs().max().item()})
        except Exception as failure:  # noqa: BLE001 - a failing path is the check's finding, not its end
            rows.append({**row, "error": f"{type(failure).__name__}: {str(failure)[:300]}"})
    baseline = next((row.get("relative_error") for row in rows if row["implementation"] == "eager"), None)
    bound = max(TOLERANCE[str(dtype).removeprefix("torch.")], 2 * (baseline or 0.0))
    for row in rows:
        if "relative_error" in row:
            row["within_tolerance"] = bool(row["relative_error"] <= bound)
    return rows


def decode_errors(check: Check) -> list[dict]:
    deadline = time.perf_counter() + check.error_minutes * 60
    rows = []
    for shape, make_config in error_shapes(check.tiny).items():
        # Every gate form on the paper's shape; a conversion's default (off) and the paper's (on K/V) on the others.
        names = tuple(GATE_CASES) if shape.startswith("paper") else ("off", "kv")
        # --tiny: one case a shape (the paper's gate off, the conversion's on K/V), every path still taken.
        cases = {name: GATE_CASES[name] for name in (names if not check.tiny else names[-1:])}
        for case, gate in cases.items():
            config = make_config(gate)
            for dtype in (torch.float32, torch.bfloat16):
                for row in case_errors(config, dtype, check, deadline):
                    rows.append({"shape": shape, "gate": case, "dtype": str(dtype).removeprefix("torch."), **row})
    return rows


# ----------------------------------------------------------------------------------------------------------------
# 2. Decode speed
# ----------------------------------------------------------------------------------------------------------------


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weight a decode step reads: every parameter but an untied input embedding (a few rows gathered)."""
    total = sum(parameter.nbytes for parameter in model.parameters())
    untied = not model.config.tie_word_embeddings
    return total - (model.get_input_embeddings().weight.nbytes if untied else 0)


def cache_bytes_estimate(model: torch.nn.Module, tokens: int) -> int:
    config = model.config
    if isinstance(config, EGMLAConfig):
        return config.kv_cache_values_per_token() * 2 * tokens
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2 * tokens


def fits(models: list[torch.nn.Module], tokens: int, device: torch.device) -> bool:
    """Whether the models' caches of `tokens` positions (and the step's transients) fit beside what is held."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return sum(1.1 * cache_bytes_estimate(model, tokens) for model in models) + 2**31 < 0.9 * free


def time_cell(models: dict, cache_kind: str, cell: tuple[int, int], check: Check, copy_rate: float) -> list[dict]:
    """ms per step of every model that fits, interleaved where they fit together; bytes read against the copy rate."""
    batch_size, context = cell
    tokens = batch_size * (context + 8)
    runnable = {name: model for name, model in models.items() if fits([model], tokens, check.torch_device)}
    together = fits(list(runnable.values()), tokens, check.torch_device)
    groups = [runnable] if together else [{name: model} for name, model in runnable.items()]
    repetitions, steps = (2, 1) if check.tiny else (5, 3)
    rows = [
        {"model": name, "cache": cache_kind, "batch": batch_size, "context": context, "skipped": "cache does not fit"}
        for name in models
        if name not in runnable
    ]
    for group in groups:
        states = {name: decode_state(model, cache_kind, batch_size, context) for name, model in group.items()}
        milliseconds = median_ms(states, repetitions, steps)
        for name, state in states.items():
            read = weight_bytes(group[name]) + cache_nbytes(state.cache)
            rows.append({
                "model": name, "cache": cache_kind, "batch": batch_size, "context": context,
                "ms_per_step": milliseconds[name], "bytes_read": read, "interleaved": together,
                "bytes_per_s": read / (milliseconds[name] / 1000),
                "share_of_copy_rate": read / (milliseconds[name] / 1000) / (copy_rate / 2),
            })  # fmt: skip
        del states
        if check.torch_device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def decode_speed(check: Check, copy_rate: float) -> list[dict]:
    device = check.torch_device
    shapes = ["tiny"] if check.tiny else ["llama-3.2-1b", "llama-3.1-8b"]
    cells = [(2, 64)] if check.tiny else [(1, 2048), (32, 8192), (128, 8192)]
    started, rows = time.perf_counter(), []
    for index, shape in enumerate(shapes):
        deadline = started + (index + 1) * check.decode_minutes * 60 / len(shapes)
        source = llama_config(shape, vocab_size=512 if check.tiny else None)
        models = {
            "source": random_model(source, torch.bfloat16, device),
            "converted": random_model(converted_config(source), torch.bfloat16, device),
        }
        for cache_kind in ("dynamic", "static"):
            for cell in cells:
                if cache_kind == "static" and time.perf_counter() > deadline:
                    rows.append({"shape": shape, "cache": cache_kind, "batch": cell[0], "context": cell[1],
                                 "skipped": "the section's minutes were spent"})  # fmt: skip
                    continue
                try:
                    rows += [{"shape": shape, **row} for row in time_cell(models, cache_kind, cell, check, copy_rate)]
                except Exception as failure:  # noqa: BLE001
                    rows.append({"shape": shape, "cache": cache_kind, "batch": cell[0], "context": cell[1],
                                 "error": f"{type(failure).__name__}: {str(failure)[:300]}"})  # fmt: skip
                torch._dynamo.reset()  # each cell compiles its own static shapes
        del models
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------------------------
# 3. Conversion
# ----------------------------------------------------------------------------------------------------------------

# `egmla convert` in a child process that reports its peak device memory (the parent holds none of it).
CONVERT = """
import json, sys, torch
from egmla.cli import main
main(sys.argv[2:])
peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
open(sys.argv[1], "w").write(json.dumps({"peak_device_bytes": peak}))
"""
TINY_CONVERT = ["--calibration-blocks", "4", "--block-size", "64", "--reconstruction-steps", "3", "--steps", "2",
                "--sampled-blocks", "8", "--held-aside-samples", "3",
                "--eval-documents", "4"]  # fmt: skip


def conversion(check: Check, deadline: float) -> list[dict]:
    shape = "tiny" if check.tiny else "llama-3.2-1b"
    dtype = "float32" if check.tiny else "bfloat16"
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        gigabytes = make_source(scratch / "source", SHAPES[shape], None, dtype, TOKENIZER)
        out, measured = scratch / "converted", scratch / "peak.json"
        flags = ["--out", str(out), "--kv-cut", str(KV_CUT), "--train-text", str(check.text), "--device", check.device,
                 "--dtype", dtype, "--max-minutes", str(check.recovery_minutes)]  # fmt: skip
        command = [sys.executable, "-c", CONVERT, str(measured), "convert", str(scratch / "source"), *flags]
        command += TINY_CONVERT if check.tiny else []
        started = time.perf_counter()
        environment = {**os.environ, "TQDM_DISABLE": "1"}
        try:
            timeout = max(10.0, deadline - started)
            result = subprocess.run(
                command, capture_output=True, text=True, check=False, env=environment, timeout=timeout
            )
        except subprocess.TimeoutExpired as stopped:
            tail = (stopped.stderr or b"")[-1500:]
            return [{"shape": shape, "error": f"stopped after {timeout:.0f} s (--minutes): {tail!r}"}]
        wall = time.perf_counter() - started
        if result.returncode != 0:
            return [{"shape": shape, "error": result.stderr[-1500:]}]
        report = json.loads((out / "conversion_report.json").read_text())
        peak = json.loads(measured.read_text())["peak_device_bytes"]
    return [{
        "shape": shape, "device": check.device, "dtype": dtype, "checkpoint_gb": round(gigabytes, 3),
        "wall_s": round(wall, 1), "stage_seconds": report["stage_seconds"], "peak_device_gb": round(peak / 1e9, 2),
        "kv_values_per_token_per_layer": report["budget"]["values_per_token_per_layer"],
        "held_out_perplexity": report.get("perplexity", {}), "recovery_minutes": check.recovery_minutes,
    }]  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# 4. The paper's figure
# ----------------------------------------------------------------------------------------------------------------


def figure_bench(check: Check) -> TrainBench:
    if check.tiny:
        return TrainBench(train_text=check.text, hidden_size=64, layers=2, heads=4, mla_kv_lora_rank=32,
                          egmla_kv_lora_rank=8, gate_dims=(16,), batch_size=4, block_size=64, eval_blocks=4)  # fmt: skip
    # The paper's ratio of latents (MLA-base 256 against EG-MLA 64), at a width the text and minutes can train.
    return TrainBench(train_text=check.text, hidden_size=384, layers=6, heads=6, mla_kv_lora_rank=256,
                      egmla_kv_lora_rank=64, gate_dims=(256,), batch_size=32, block_size=512, learning_rate=2e-3,
                      eval_blocks=64)  # fmt: skip


def figure_variants(bench: TrainBench) -> dict[str, dict]:
    gate = bench.gate_dims[0]
    small, large = bench.egmla_kv_lora_rank, bench.mla_kv_lora_rank
    return {
        f"MLA r{large}": {"kv_lora_rank": large, "gate_embedding_dim": 0},
        f"MLA r{small}": {"kv_lora_rank": small, "gate_embedding_dim": 0},
        f"EG-MLA r{small}, gate on K/V": {"kv_lora_rank": small, "gate_embedding_dim": gate, "gate_position": "kv"},
        f"EG-MLA r{small}, gate on latent": {
            "kv_lora_rank": small, "gate_embedding_dim": gate, "gate_position": "latent"
        },
    }  # fmt: skip


def train_run(bench: TrainBench, tokenizer, dims: dict, blocks: tuple, steps: int, seed: int) -> tuple[float, dict]:
    """Trains one variant from scratch for `steps`; (held-out loss, its config's cache figures)."""
    train_blocks, held_out = blocks
    config = model_config(bench, tokenizer, dims["kv_lora_rank"], dims["gate_embedding_dim"])
    config.gate_position = dims.get("gate_position", config.gate_position)
    torch.manual_seed(seed)
    model = EGMLAForCausalLM(config)
    settings = FinetuneSettings.from_scratch(
        steps=steps, batch_size=bench.batch_size, learning_rate=bench.learning_rate, warmup_steps=max(1, steps // 20),
        save_every=0, seed=seed, mixed_precision="auto",
    )  # fmt: skip
    result = finetune(model, None, train_blocks, settings)
    loss, _ = loss_and_accuracy(result.model, held_out.to(result.model.device), bench.batch_size)
    values = config.kv_cache_values_per_token()
    return loss, {"kv_values_per_token": values, "kv_bytes_per_token_bf16": 2 * values}


def paper_figure(check: Check) -> list[dict]:
    bench = figure_bench(check)
    tokenizer = AutoTokenizer.from_pretrained(bench.tokenizer)
    train_documents, held_out_documents = split_documents(read_documents(check.text), 0.1)
    blocks = (
        token_blocks(tokenizer, train_documents, bench.block_size),
        token_blocks(tokenizer, held_out_documents, bench.block_size)[: bench.eval_blocks],
    )
    variants = figure_variants(bench)
    # Steps sized by a timed probe of the slowest variant (the gate on K/V), the same for every run.
    probe_steps = 2 if check.tiny else 8
    started = time.perf_counter()
    train_run(bench, tokenizer, variants[list(variants)[2]], blocks, probe_steps, seed=100)
    per_step = (time.perf_counter() - started) / probe_steps
    runs = len(variants) * check.seeds
    steps = max(2, int(check.figure_minutes * 60 / runs / per_step)) if not check.tiny else 3
    rows = []
    for name, dims in variants.items():
        losses, cache = [], {}
        for seed in range(check.seeds):
            loss, cache = train_run(bench, tokenizer, dims, blocks, steps, seed)
            losses.append(loss)
        rows.append({
            "variant": name, **dims, **cache, "seeds": check.seeds, "steps": steps,
            "tokens": steps * bench.batch_size * bench.block_size, "train_tokens_available": blocks[0].numel(),
            "held_out_loss_mean": statistics.mean(losses),
            "held_out_loss_spread": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "held_out_losses": losses,
        })  # fmt: skip
    return rows


# ----------------------------------------------------------------------------------------------------------------
# The run and its outputs
# ----------------------------------------------------------------------------------------------------------------


def environment(check: Check) -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = check.torch_device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(check.torch_device) if cuda else platform.processor() or "cpu",
        "tiny": check.tiny, "torch": torch.__version__, "triton": triton_version,
        "transformers": transformers.__version__, "cuda": torch.version.cuda if cuda else None,
    }  # fmt: skip


def markdown(results: dict) -> str:
    """The JSON's rows as one Markdown table per section."""
    lines = [f"# GPU check ({results['environment']['device']})", ""]
    lines.append(", ".join(f"{key} {value}" for key, value in results["environment"].items()))
    if "ceilings" in results:
        ceiling = results["ceilings"]
        lines.append(f"\ncopy rate {ceiling['copy_bytes_per_s'] / 1e9:,.0f} GB/s (read + written), bf16 matmul "
                     f"{ceiling['bf16_matmul_flops'] / 1e12:,.1f} TFLOP/s")  # fmt: skip
    for name, section in results["sections"].items():
        lines += ["", f"## {name} ({section['seconds']:.0f} s)", ""]
        rows = section["rows"]
        if not rows:
            continue
        columns = list(dict.fromkeys(key for row in rows for key in row))
        lines.append("| " + " | ".join(columns) + " |")
        lines.append("|" + "---|" * len(columns))
        for row in rows:
            lines.append("| " + " | ".join(cell(row.get(column)) for column in columns) + " |")
    return "\n".join(lines) + "\n"


def cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-2 or abs(value) >= 1e4 else f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{key} {cell(item)}" for key, item in value.items())
    return "" if value is None else str(value).replace("|", "/").replace("\n", " ")


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(results))


def run_check(check: Check) -> dict:
    """Runs the four sections; the results (written after each) as a dict."""
    deadline = time.perf_counter() + check.minutes * 60
    results = {"environment": environment(check), "settings": dataclasses.asdict(check), "sections": {}}
    results["ceilings"] = ceilings(check)
    sections = {  # the conversion last: the only section without a bound of its own
        "decode errors": lambda: decode_errors(check),
        "decode speed": lambda: decode_speed(check, results["ceilings"]["copy_bytes_per_s"]),
        "paper figure": lambda: paper_figure(check),
        "conversion": lambda: conversion(check, deadline),
    }
    for name, section in sections.items():
        started = time.perf_counter()
        try:
            rows = section()
        except Exception as failure:  # noqa: BLE001 - the next sections still run
            rows = [{"error": f"{type(failure).__name__}: {str(failure)[:1000]}"}]
        results["sections"][name] = {"seconds": round(time.perf_counter() - started, 1), "rows": rows}
        print(f"{name}: {len(rows)} rows in {results['sections'][name]['seconds']} s", flush=True)
        write(results, check.out)
        if check.torch_device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and budgets on the CPU: checks the script")
    parser.add_argument("--text", type=Path, default=EXCERPT, help="training and fitting text (default: embedded)")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    for field in ("minutes", "error_minutes", "decode_minutes", "figure_minutes", "recovery_minutes"):
        parser.add_argument(
            "--" + field.replace("_", "-"), type=float, default=Check.__dataclass_fields__[field].default
        )
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    device = args.device or ("cpu" if args.tiny else "cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device; run with --tiny on a CPU.")
    settings = {field: getattr(args, field) for field in Check.__dataclass_fields__ if field != "device"}
    check = Check(device=device, **settings)
    results = run_check(check)
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
