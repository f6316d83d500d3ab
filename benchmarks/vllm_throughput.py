"""vLLM decode tokens/s on stories260K converted by egmla against vLLM on the source Llama (the README's line).

    EGMLA_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/vllm_throughput.py

Each engine runs in its own process (vLLM keeps global state), alternately, `--rounds` times each; the medians and
their ratio are printed. The source's head_dim 8 is not a size vLLM's CPU attention takes, so the Llama is served
padded exactly to head_dim 32: each head's q/k/v rows padded with zeros, the rope kept on the first 8 dims
(`partial_rotary_factor` 0.25, so the same frequencies), the query scaled by 2 so that 1/sqrt(32) scores as
1/sqrt(8) did, and the padded value dims dropped by zero columns of o_proj. Its greedy tokens are checked against
the unpadded Llama in transformers.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from egmla.conversion import ConversionOptions, convert_llama_to_egmla, load_llama

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "integrations" / "vllm" / "tests")]
from test_vllm_plugin import TOKENIZER, VLLM_ENV, WORKER  # noqa: E402

STORIES260K = ROOT / "tests" / "assets" / "stories260K-hf"
PADDED_HEAD_DIM = 32


def pad_heads(weight: torch.Tensor, heads: int, head_dim: int, scale: float = 1.0) -> torch.Tensor:
    """[heads * head_dim, in] -> [heads * PADDED_HEAD_DIM, in], each head's rows first, zeros after."""
    rows = weight.view(heads, head_dim, -1) * scale
    return torch.nn.functional.pad(rows, (0, 0, 0, PADDED_HEAD_DIM - head_dim)).reshape(heads * PADDED_HEAD_DIM, -1)


def padded_llama(source: Path, folder: Path) -> Path:
    llama = load_llama(source)
    config = llama.config
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    state = llama.state_dict()
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.self_attn."
        state[prefix + "q_proj.weight"] = pad_heads(state[prefix + "q_proj.weight"], heads, head_dim,
                                                    (PADDED_HEAD_DIM / head_dim) ** 0.5)  # fmt: skip
        for name in ("k_proj", "v_proj"):
            state[prefix + name + ".weight"] = pad_heads(state[prefix + name + ".weight"], kv_heads, head_dim)
        state[prefix + "o_proj.weight"] = pad_heads(state[prefix + "o_proj.weight"].T, heads, head_dim).T.contiguous()
    config.head_dim = PADDED_HEAD_DIM
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": head_dim / PADDED_HEAD_DIM}
    config.save_pretrained(folder)
    from safetensors.torch import save_file

    state.pop("lm_head.weight", None)  # tied
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, folder / "model.safetensors")
    return folder


def egmla_folder(source: Path, folder: Path, options: ConversionOptions) -> Path:
    convert_llama_to_egmla(load_llama(source), options).save_pretrained(folder)
    return folder


def serve(python: str, folder: Path, prompts: list, max_tokens: int) -> dict:
    request = json.dumps({"folder": str(folder), "prompts": prompts, "max_tokens": max_tokens, "logprobs": 1,
                          "max_model_len": 512})  # fmt: skip
    done = subprocess.run([python, str(WORKER), request], capture_output=True, text=True,
                          env={**os.environ, **VLLM_ENV}, check=True)  # fmt: skip
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()
    python = os.environ["EGMLA_VLLM_PYTHON"]
    prompts = [[1, 403, 407, 261, 378], [1, 365], [1, 403, 270], [1, 412, 300, 261]]
    with tempfile.TemporaryDirectory() as scratch:
        latent = ConversionOptions(kv_lora_rank=32, rope_split="shared", gate_embedding_dim=32, gate_position="latent",
                                   factorization="weight")  # fmt: skip
        rebuilt = ConversionOptions(
            kv_lora_rank=32, rope_split="exact", gate_embedding_dim=32, gate_position="kv", factorization="weight"
        )
        folders = {
            "Llama (source, padded to head_dim 32)": padded_llama(STORIES260K, Path(scratch) / "llama"),
            "EG-MLA, gate on the latent (absorbed decode)": egmla_folder(STORIES260K, Path(scratch) / "latent", latent),
            "EG-MLA, RoPE-exact, gate on K/V (rebuilt every step)": egmla_folder(
                STORIES260K, Path(scratch) / "rebuilt", rebuilt
            ),
        }
        for folder in folders.values():
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(TOKENIZER / name, folder / name)
        speeds = {name: [] for name in folders}
        results = {}
        for _ in range(args.rounds):
            for name, folder in folders.items():
                results[name] = serve(python, folder, prompts, args.max_tokens)
                speeds[name].append(results[name]["tokens_per_second"])
    source = load_llama(STORIES260K)
    with torch.no_grad():
        expected = source.generate(torch.tensor([prompts[0]]), max_new_tokens=args.max_tokens, do_sample=False)
    llama_name = next(iter(folders))
    reached = results[llama_name]["tokens"][0]
    assert reached == expected[0, len(prompts[0]) :].tolist()[: len(reached)], "the padded Llama is not exact"
    print(f"{len(prompts)} sequences x {args.max_tokens} tokens, greedy, fp32, {args.rounds} alternating rounds")
    print("| model in vLLM | tokens/s (median) | vs Llama | KV bytes/token |\n|---|---|---|---|")
    baseline = statistics.median(speeds[llama_name])
    for name in folders:
        speed = statistics.median(speeds[name])
        print(f"| {name} | {speed:.1f} | {speed / baseline:.2f}x | {results[name]['kv_bytes_per_token']:,} |")


if __name__ == "__main__":
    main()
