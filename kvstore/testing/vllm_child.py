"""A vLLM process that tests and benchmarks drive: requests on stdin (one JSON per line),
results on a pipe.

Run as ``python vllm_child.py MODEL_DIR SOCKET|- EXTRA_CONFIG_JSON RESULT_FD [ENGINE_JSON]``
("-": no connector; ENGINE_JSON: ``LLM`` arguments over the defaults below, and ``kv_role``).
Writes ``READY`` to the file descriptor ``RESULT_FD`` once the engine is up, then one ``RESULT
{json}`` line per request line ``{"prompt_token_ids": [...], "cache_salt": null, "max_tokens":
4}`` (or ``"batch": [[...], ...]``, run together; or ``{"reset_prefix_cache": {"reset_connector":
true}}``, answered ``RESULT {"reset": ...}``, ``LLM.reset_prefix_cache``'s answer); vLLM's and
the connector's logs go to stdout and stderr, never in between.
The guard matters: vLLM spawns, and a spawned child re-imports this file.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _counter(llm, name: str) -> float:
    total = 0.0
    for m in llm.get_metrics():
        if m.name == name:
            total += float(getattr(m, "value", 0) or 0)
    return total


def _by_label(llm, name: str, label: str) -> dict[str, float]:
    """A labelled counter per value of ``label`` (summed over the other labels)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name == name:
            key = m.labels.get(label, "")
            out[key] = out.get(key, 0.0) + float(getattr(m, "value", 0) or 0)
    return out


def _output(out) -> dict:
    """One request's tokens, top-5 logprobs per step, cached tokens and time to first token."""
    completion = out.outputs[0]
    metrics = getattr(out, "metrics", None)
    return {
        "token_ids": list(completion.token_ids),
        "logprobs": [{str(k): v.logprob for k, v in step.items()}
                     for step in completion.logprobs],
        "num_cached_tokens": out.num_cached_tokens,
        "ttft_s": (metrics.first_token_latency if metrics is not None
                   and getattr(metrics, "first_token_latency", None) else None),
    }


def _emit(results, line: str) -> None:
    results.write(line + "\n")  # one write: the line arrives whole
    results.flush()


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    model_dir, socket_path = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3])
    result_fd = int(sys.argv[4])
    # Processes vLLM spawns (its CPU workers) do not get the pipe; forked ones would, and then
    # only a request's timeout, not the pipe's end, tells the driver this process died.
    os.set_inheritable(result_fd, False)
    results = os.fdopen(result_fd, "w")
    engine = {"max_model_len": 8192, "enforce_eager": True, "max_num_batched_tokens": 8192,
              "kv_cache_memory_bytes": 64 << 20, "disable_log_stats": False, "seed": 0}
    engine.update(json.loads(sys.argv[5]) if len(sys.argv) > 5 else {})
    kv_role = engine.pop("kv_role", "kv_both")
    kwargs = {}
    if socket_path != "-":
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "offload.vllm_connector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"kv_store_socket": socket_path, **extra},
        }
    llm = LLM(model_dir, **engine, **kwargs)
    _emit(results, "READY")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("reset_prefix_cache") is not None:
            reset = llm.reset_prefix_cache(**req["reset_prefix_cache"])
            _emit(results, "RESULT " + json.dumps({"reset": reset}))
            continue
        # One prompt, or a batch of them run together ("batch": [[ids...], ...]).
        batch = req["batch"] if req.get("batch") is not None else [req["prompt_token_ids"]]
        prompts = [{"prompt_token_ids": ids} for ids in batch]
        if req.get("cache_salt"):
            for prompt in prompts:
                prompt["cache_salt"] = req["cache_salt"]
        params = SamplingParams(max_tokens=req.get("max_tokens", 4), temperature=0.0,
                                logprobs=5, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        per_prompt = [_output(out) for out in outs]
        result = {
            **per_prompt[0],
            "outputs": per_prompt,
            "elapsed_s": elapsed,
            "external_hits": _counter(llm, "vllm:external_prefix_cache_hits"),
            "external_queries": _counter(llm, "vllm:external_prefix_cache_queries"),
            "preemptions": _counter(llm, "vllm:num_preemptions"),
            # Per source: device, host (DRAM), disk (SSD), p2p (another node's daemon).
            "cached_by_source": _by_label(llm, "vllm:prompt_tokens_cached_by_source", "source"),
            # The connector's counters as vLLM's /metrics shows them (worker and scheduler).
            "store_events": _by_label(llm, "vllm:kvstore_events", "event"),
        }
        _emit(results, "RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
