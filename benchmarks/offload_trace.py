"""Offload on against off, in process, step by step: where does a request's TTFT go?

The multi-turn workload of benchmarks.multiturn, as token ids (a shared system prompt, a history
per user, then rounds of question + generated answer), replayed against a fresh `LLMEngine` per
configuration with the same seeded Poisson arrivals (one conversation per user, a user's next round
only after its last answer). No HTTP and no tokenizer: what differs between the configurations is
the engine and the store alone. Configurations: `off`, `write-through`, `evict`, `private`
(write-through, the arena not shared as the HBM tier); each with offload gets a fresh
`kvstore serve`. Regimes as in benchmarks.multiturn.sweep: `fits` sizes the HBM pool for the
whole working set, `pressure` for 1/--pressure-factor of it.

Per request: TTFT from its scheduled arrival (a request waits for the next step boundary like an
HTTP one), cached tokens by tier. Per step: the engine's ``StepTiming`` (deferred store work,
taking requests in, scheduling, the forward) plus the time of ``flush_offload`` run after the
outputs, as the server does. JSON to benchmarks/results/.

    python -m benchmarks.offload_trace --model-dir DIR --device cuda --regime fits --qps 1
    python -m benchmarks.offload_trace --model-dir /tmp/tiny --device cpu --users 4 --rounds 2 \\
        --system-prompt-len 64 --history-len 64 --answer-len 4 --qps 4   # smoke
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import command, machine_info, now_iso, percentile, today, write_result
from server.demo import start_embedded_daemon

CONFIGS = {  # name: EngineConfig overrides
    "off": {},
    "write-through": {"kv_offload": True, "kv_offload_policy": "write-through"},
    "evict": {"kv_offload": True, "kv_offload_policy": "evict"},
    "private": {"kv_offload": True, "kv_offload_share_hbm": False},
    # The old prefill order (running sequences' chunks first, in admission order): the
    # scheduler's shortest-first order against it, with and without the store.
    "fcfs": {"kv_offload": True, "prefill_order": "fcfs"},
    "fcfs-off": {"prefill_order": "fcfs"},
    # Short steps while a restore is in flight or a first token is due (latency_chunk_tokens).
    "short-steps": {"kv_offload": True, "latency_chunk_tokens": 512},
}


@dataclasses.dataclass
class _User:
    tokens: list[int]  # the conversation so far (the next prompt starts with it)
    questions: list[list[int]]
    round: int = 0


def make_users(args: argparse.Namespace, vocab: int) -> list[_User]:
    """Seeded token-id conversations: the same for every configuration."""
    rng = np.random.default_rng(args.seed)
    system = rng.integers(10, vocab, args.system_prompt_len).tolist()
    users = []
    for _ in range(args.users):
        history = rng.integers(10, vocab, args.history_len).tolist()
        questions = [rng.integers(10, vocab, args.question_len).tolist()
                     for _ in range(args.rounds)]
        users.append(_User(system + history, questions))
    return users


def run_config(args: argparse.Namespace, name: str, num_kv_blocks: int, dram_bytes: int) -> dict:
    """One fresh engine (and daemon) through the whole schedule."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    workdir = Path(tempfile.mkdtemp(prefix="offload-trace-"))
    overrides = dict(CONFIGS[name])
    daemon = None
    if overrides.get("kv_offload"):
        daemon, socket_path = start_embedded_daemon(workdir, str(dram_bytes), "0")
        overrides["kv_store_socket"] = str(socket_path)
    engine = LLMEngine(EngineConfig(str(args.model_dir), device=args.device,
                                    num_kv_blocks=num_kv_blocks, max_model_len=args.max_model_len,
                                    max_num_seqs=args.users, **overrides))
    try:
        engine.warm_up()  # as `kvengine serve` does before it listens
        vocab = engine.vocab_size
        warm = np.random.default_rng(12345)
        params = SamplingParams(temperature=0.0, max_tokens=args.answer_len, ignore_eos=True)
        for i, n in enumerate((16, min(1024, args.max_model_len // 2))):  # kernels, prefill rate
            engine.add_request(f"warm-{i}", warm.integers(10, vocab, n).tolist(), params)
            while engine.has_unfinished_requests():
                engine.step()
                engine.flush_offload()
        users = make_users(args, vocab)
        arrivals = random.Random(f"arrivals:{args.seed}")
        idle = collections.deque(range(args.users))
        total = args.users * args.rounds
        live: dict[str, dict] = {}
        records: list[dict] = []
        steps: list[dict] = []
        started = time.perf_counter()
        next_arrival = 0.0
        num_sent = 0
        while num_sent < total or live:
            now = time.perf_counter() - started
            if now >= args.duration_s:
                total = num_sent  # no more arrivals; finish what is in flight
            while num_sent < total and next_arrival <= now and idle:
                user = idle.popleft()
                u = users[user]
                prompt = u.tokens + u.questions[u.round]
                rid = f"u{user}-r{u.round}"
                engine.add_request(rid, prompt, params)
                live[rid] = {"user": user, "round": u.round, "arrival_s": next_arrival,
                             "added_s": now, "prompt_tokens": len(prompt), "prompt": prompt}
                num_sent += 1
                next_arrival += arrivals.expovariate(args.qps)
            if num_sent < total and not idle:
                next_arrival = max(next_arrival, now)  # every user busy: no catch-up burst
            if not live:
                time.sleep(max(0.0, min(next_arrival, args.duration_s) - now))
                continue
            outputs = engine.step()
            t_out = time.perf_counter() - started
            engine.flush_offload()
            flush_after_s = time.perf_counter() - started - t_out
            timing = engine.last_step
            steps.append({"t_s": t_out, **dataclasses.asdict(timing),
                          "flush_after_s": flush_after_s})
            for out in outputs:
                rec = live.get(out.request_id)
                if rec is None:
                    continue
                if "ttft_s" not in rec and out.token_ids:
                    rec["ttft_s"] = t_out - rec["arrival_s"]
                    rec["cached_tokens"] = out.num_cached_tokens
                    rec["cached_tokens_by_tier"] = dict(out.cached_tokens_by_tier)
                if out.finished:
                    del live[out.request_id]
                    u = users[rec["user"]]
                    u.tokens = rec.pop("prompt") + list(out.token_ids)
                    u.round += 1
                    if u.round < args.rounds:
                        idle.append(rec["user"])
                    records.append(rec)
        wall_s = time.perf_counter() - started
        stats = engine.stats()
    finally:
        engine.close()
        if daemon is not None:
            daemon.terminate()
            daemon.wait(60)
    return {"config": name, "num_kv_blocks": num_kv_blocks, "wall_s": wall_s,
            "summary": summarize(records, steps), "records": records, "steps": steps,
            "kv_offload": stats["kv_offload"], "num_preemptions": stats["num_preemptions"]}


def summarize(records: list[dict], steps: list[dict]) -> dict:
    ttft = [r["ttft_s"] * 1e3 for r in records]
    by_round: dict[int, list[float]] = collections.defaultdict(list)
    for r in records:
        by_round[r["round"]].append(r["ttft_s"] * 1e3)
    step_ms = {key: sum(s[key] for s in steps) * 1e3
               for key in ("flush_s", "add_s", "schedule_s", "execute_s", "total_s",
                           "flush_after_s")}
    prefill = [s for s in steps if s["num_tokens"] > s["num_seqs"]]
    loading = [s for s in steps if s["num_loading"]]
    decode = [s for s in steps if s["num_seqs"] and s["num_tokens"] == s["num_seqs"]]
    return {
        "num_requests": len(records),
        "ttft_mean_ms": statistics.fmean(ttft) if ttft else None,
        "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p90_ms": percentile(ttft, 0.9),
        "ttft_mean_ms_by_round": {k: statistics.fmean(v) for k, v in sorted(by_round.items())},
        "cached_tokens": sum(r.get("cached_tokens") or 0 for r in records),
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "num_steps": len(steps),
        "step_ms_sum": step_ms,
        "decode_step_execute_ms_mean": (statistics.fmean(s["execute_s"] for s in decode) * 1e3
                                        if decode else None),
        # Loads overlap other requests' steps: steps that ran while a restore was in flight,
        # against steps (and their time) in which the engine had only loads to wait for.
        "overlap": {"steps_loading": len(loading),
                    "steps_computing_while_loading": sum(1 for s in loading if s["num_seqs"]),
                    "ms_idle_waiting_for_loads": sum(s["total_s"] for s in loading
                                                     if not s["num_seqs"]) * 1e3},
        "prefill_step_execute_ms_per_1k_tokens": (
            sum(s["execute_s"] for s in prefill) * 1e6 / sum(s["num_tokens"] for s in prefill)
            if prefill else None),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--configs", default="off,write-through,evict,private")
    p.add_argument("--regime", choices=("fits", "pressure"), default="fits")
    p.add_argument("--pressure-factor", type=float, default=3.5)
    p.add_argument("--qps", type=float, default=1.0)
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--users", type=int, default=12)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--system-prompt-len", type=int, default=1024)
    p.add_argument("--history-len", type=int, default=2048)
    p.add_argument("--question-len", type=int, default=30)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown --configs {unknown}; known: {sorted(CONFIGS)}")
    from engine.kv_cache import kv_block_bytes
    from engine.model_config import ModelConfig

    mc = ModelConfig.load(args.model_dir)
    block_bytes = kv_block_bytes(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim,
                                 2 if args.device == "cuda" else 4)
    turn = args.question_len + args.answer_len
    longest = args.system_prompt_len + args.history_len + args.rounds * turn
    working_set = args.system_prompt_len + args.users * (longest - args.system_prompt_len)
    fits_blocks = -(-working_set // 16) + args.users * 4 + 64
    num_kv_blocks = fits_blocks if args.regime == "fits" else max(
        int(fits_blocks / args.pressure_factor), -(-longest // 16) * 2 + 16)
    dram_bytes = int(fits_blocks * block_bytes * 1.5)
    from server.cli import tune_interpreter

    tune_interpreter()  # the GIL switch interval `kvengine serve` runs with, not Python's 5 ms
    points = []
    for name in configs:
        point = run_config(args, name, num_kv_blocks, dram_bytes)
        s = point["summary"]
        print(f"{name:>14}: TTFT mean {s['ttft_mean_ms']:7.1f} ms  p50 {s['ttft_p50_ms']:7.1f}"
              f"  p90 {s['ttft_p90_ms']:7.1f}  by round "
              + " ".join(f"{v:.1f}" for v in s["ttft_mean_ms_by_round"].values())
              + f"  steps {s['num_steps']} (loading {s['overlap']['steps_loading']}, "
              + f"computing while loading {s['overlap']['steps_computing_while_loading']})  "
              + " ".join(f"{k[:-2]} {v:.0f}" for k, v in s["step_ms_sum"].items()) + " ms",
              flush=True)
        points.append(point)
    result = {"benchmark": "offload_trace", "model_dir": str(args.model_dir),
              "device": args.device, "regime": args.regime, "args": vars(args) | {
                  "model_dir": str(args.model_dir)},
              "num_kv_blocks": num_kv_blocks, "working_set_blocks": -(-working_set // 16),
              "switch_interval_s": sys.getswitchinterval(),
              "machine": machine_info(), "date": now_iso(),
              "command": command("python -m benchmarks.offload_trace", argv),
              "points": points}
    stem = f"offload_trace-{args.tag or args.device}-{args.regime}-{today()}"
    path = write_result(args.out, f"{stem}.json", result, indent=1, default=str)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
