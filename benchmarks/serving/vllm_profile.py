"""Where a vLLM step goes: one engine on one folder (an egmla folder, or a Llama one), its prompts' prefill and
`--max-tokens` greedy tokens in `--dtype` (bf16 by default) under torch.profiler, the operators' CPU time printed
by operator and input shape.

    EGMLA_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/serving/vllm_profile.py runs/smollm2-egmla --sequences 16

Run beside `benchmarks/serving/vllm_throughput.py` (which saves no Llama folder of the source: give one, e.g. the source
saved by `egmla.conversion.load_llama(...).save_pretrained(DIR)` with its tokenizer). The engine runs in the vLLM
venv's python, in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the profiler sees the model's operators; vLLM's
own Python time inside a custom operator shows as that operator's self time.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "integrations" / "vllm" / "tests")]
from test_vllm_plugin import VLLM_ENV  # noqa: E402

PROFILE = """
import sys
import torch
from vllm import LLM, SamplingParams

folder, count, prompt_tokens, max_tokens, rows = sys.argv[1], *map(int, sys.argv[2:6])
llm = LLM(model=folder, dtype=sys.argv[6], max_model_len=prompt_tokens + max_tokens, max_num_seqs=count,
          enforce_eager=True, seed=0)
prompts = [{"prompt_token_ids": list(range(100 + i, 100 + i + prompt_tokens))} for i in range(count)]
llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
llm.reset_prefix_cache()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
print(profile.key_averages(group_by_input_shape=True).table(
    sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=40, max_shapes_column_width=90))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the model folder vLLM serves")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--rows", type=int, default=30, help="operators printed, by self CPU time")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args()
    command = [os.environ["EGMLA_VLLM_PYTHON"], "-c", PROFILE, str(args.folder), str(args.sequences),
               str(args.prompt_tokens), str(args.max_tokens), str(args.rows), args.dtype]  # fmt: skip
    subprocess.run(command, check=True, env={**os.environ, **VLLM_ENV})


if __name__ == "__main__":
    main()
