"""Where the time of one prefill step goes: a few new tokens over a cached prefix (a warm chat
turn: the TTFT of every HBM hit and every restore), or a whole prompt.

For each context length: the prefix is prefilled once (then cached in HBM), and then --reps
requests each add --new-tokens fresh tokens to it; each such request is exactly one step. Reported
per length: the step's wall time (median), the forward's device time by CUDA events, the host time
spent before the device got the first kernel, and a cProfile of one step (top functions by own
time) written to the JSON. No HTTP, no store.

    python -m benchmarks.step_profile --model-dir DIR --device cuda --lengths 1024,4096,16384
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import command, machine_info, now_iso, today, write_result
from benchmarks.ttft_ladder import ttft
from engine.config import DEFAULT_MAX_PREFILL_GRAPH_TOKENS


def _device_ms(engine, prompt: list[int], tag: str, params) -> float | None:
    """GPU time between an event before the step and one after it."""
    if engine.device != "cuda":
        return None
    import cupy as cp

    start, stop = cp.cuda.Event(), cp.cuda.Event()
    engine.add_request(tag, prompt, params)
    start.record()
    engine.step()
    stop.record()
    stop.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    return cp.cuda.get_elapsed_time(start, stop)


def _forward_split(engine, prompt: list[int], tag: str, params, reps: int) -> dict | None:
    """The step's forward alone, three ways: host time to enqueue it eagerly, its eager time by
    CUDA events, and the replay of the same forward captured as a CUDA graph (device time with
    no launch gaps). Host-bound when the first two agree and the third is much smaller."""
    if engine.device != "cuda":
        return None
    import cupy as cp

    engine.add_request(tag, prompt, params)
    with engine._lock:  # the step's first half by hand: admit and schedule, then stop there
        inbox, engine._inbox = engine._inbox, []
    for seq in inbox:
        engine.scheduler.add(seq)
    batch = engine.scheduler.schedule()
    runner = engine.runner
    forward_batch, _ = runner.prepare(batch)
    host, eager, replay = [], [], []
    for _ in range(reps):
        cp.cuda.Device().synchronize()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        t0 = time.perf_counter()
        start.record()
        runner.forward(forward_batch)
        stop.record()
        host.append((time.perf_counter() - t0) * 1e3)
        stop.synchronize()
        eager.append(cp.cuda.get_elapsed_time(start, stop))
    graph = runner.ops.capture_graph(lambda: runner.forward(forward_batch))
    for _ in range(reps):
        replay.append(_device_time(cp, graph.replay))
    attention = _attention_ops(runner, forward_batch, reps)
    engine.abort_request(tag)  # never advanced: its blocks go back at the next step
    engine.step()
    return {"num_tokens": batch.num_tokens, "host_enqueue_ms": statistics.median(host),
            "eager_device_ms": statistics.median(eager),
            "graph_replay_ms": statistics.median(replay), **attention}


def _device_time(cp, fn) -> float:
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop)


def _attention_ops(runner, forward_batch, reps: int) -> dict:
    """The step's prefill attention, every layer, on its real tables and context, replayed from
    a CUDA graph (device time, no launch gaps; per layer): cuDNN split over the context (the
    default for short queries), cuDNN as one paged call, and our kernel; and the whole forward
    replayed with each of the latter two (``graph_replay_ms`` is the default's)."""
    import cupy as cp

    from kernels import attention

    ops, kv = runner.ops, runner.kv_cache.array
    cfg = runner.model_config
    fb = forward_batch
    q = cp.random.standard_normal((fb.token_ids.shape[0], cfg.num_heads, cfg.head_dim),
                                  dtype=cp.float32).astype(ops.act_dtype)
    scale = cfg.head_dim ** -0.5

    def every_layer(ours: bool):
        def run():
            out = None
            for layer in range(cfg.num_layers):
                if ours:
                    out = attention.paged_attention_prefill(
                        q, kv, layer, fb.block_tables, fb.cu_seqlens_q, fb.context_lens, scale)
                else:
                    out = ops.paged_attention_prefill(
                        q, kv, layer, fb.block_tables, fb.cu_seqlens_q, fb.context_lens, scale,
                        fb.max_query_len, fb.max_context_len)
            return out
        return run

    def replayed(fn, per: int = 1) -> float | str:
        try:
            graph = ops.capture_graph(fn)
        except Exception as exc:  # a path that cannot be captured says so in the result
            return f"not captured: {type(exc).__name__}: {exc}"
        graph.replay()
        return statistics.median(_device_time(cp, graph.replay) for _ in range(reps)) / per

    out = {"attention_ours_ms": replayed(every_layer(True), cfg.num_layers)}
    backends = dict(ops.attention_backends)
    ops.attention_backends["prefill"] = "ours"
    try:
        out["graph_replay_ours_attention_ms"] = replayed(lambda: runner.forward(fb))
    finally:
        ops.attention_backends.update(backends)
    cudnn = getattr(ops, "_cudnn", None)
    if cudnn is None:
        return out
    out["attention_cudnn_split_ms"] = replayed(every_layer(False), cfg.num_layers)
    split, cudnn.split = cudnn.split, None
    try:
        out["attention_cudnn_whole_ms"] = replayed(every_layer(False), cfg.num_layers)
        out["graph_replay_unsplit_ms"] = replayed(lambda: runner.forward(fb))
    finally:
        cudnn.split = split
    return out


def profile_length(engine, length: int, args: argparse.Namespace, rng) -> dict:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = engine.vocab_size
    prefix = rng.integers(10, vocab, length).tolist()
    cold_s = ttft(engine, prefix + [11], f"cold-{length}")[0]

    def turn(i: int) -> list[int]:
        return prefix + rng.integers(10, vocab, args.new_tokens).tolist()

    walls = [ttft(engine, turn(i), f"w-{length}-{i}")[0] for i in range(args.reps)]
    device = [_device_ms(engine, turn(i), f"d-{length}-{i}", params) for i in range(args.reps)]
    split = _forward_split(engine, turn(0), f"f-{length}", params, args.reps)
    prof = cProfile.Profile()
    prof.enable()
    ttft(engine, turn(0), f"p-{length}")
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    cached = engine.block_manager.num_cached_blocks
    engine.reset_prefix_cache()
    return {"context_tokens": length, "new_tokens": args.new_tokens, "cold_ms": cold_s * 1e3,
            "step_wall_ms_p50": statistics.median(walls) * 1e3,
            "step_wall_ms": [w * 1e3 for w in walls],
            "step_device_ms_p50": (statistics.median(device) if device[0] is not None else None),
            "cached_blocks": cached, "forward_split": split,
            "profile_tottime": text.getvalue()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--lengths", default="1024,4096,16384")
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-prefill-graph-tokens", type=int,
                   default=DEFAULT_MAX_PREFILL_GRAPH_TOKENS)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]

    from engine import EngineConfig, LLMEngine

    max_len = max(lengths) + args.new_tokens + 16
    blocks = 3 * -(-max_len // 16) + 64
    engine = LLMEngine(EngineConfig(str(args.model_dir), device=args.device, num_kv_blocks=blocks,
                                    max_model_len=max_len, max_num_batched_tokens=max_len,
                                    enforce_eager=args.enforce_eager,
                                    max_prefill_graph_tokens=args.max_prefill_graph_tokens))
    rng = np.random.default_rng(0)
    rows = []
    try:
        profile_length(engine, min(lengths), args, rng)  # warm-up: kernels compiled
        for n in lengths:
            row = profile_length(engine, n, args, rng)
            rows.append(row)
            print(f"{n:6d} + {args.new_tokens} tokens: step wall p50 {row['step_wall_ms_p50']:6.1f}"
                  f" ms, device {row['step_device_ms_p50'] or float('nan'):6.1f} ms "
                  f"(cold prefill {row['cold_ms']:.1f} ms)", flush=True)
            print(f"        forward alone: {row['forward_split']}", flush=True)
            print(row["profile_tottime"][:2500], flush=True)
    finally:
        engine.close()
    result = {"benchmark": "step_profile", "model_dir": str(args.model_dir),
              "device": args.device, "rows": rows, "machine": machine_info(), "date": now_iso(),
              "command": command("python -m benchmarks.step_profile", argv)}
    stem = f"step_profile-{args.tag or args.device}-{today()}"
    path = write_result(args.out, f"{stem}.json", result, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
