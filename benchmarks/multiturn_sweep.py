"""The multi-turn sweep: offload on vs off, at several loads, with the working set in HBM or not.

For every regime x offload x QPS point, a fresh `kvstore serve` (offload on only) and a fresh
`kvengine serve` (subprocess, free port) start, take two warm-up requests, and serve the
benchmarks.multiturn workload; then both stop, so no point inherits another's caches. Regimes:

- `fits`: --num-kv-blocks holds every user's whole conversation (working set <= HBM pool).
- `pressure`: the HBM pool is --pressure-factor times smaller than the users' total context (but
  holds the longest prompt), and the daemon's --dram holds all of it (HBM < working set < DRAM).

Writes one JSON (every point's summary and records, the sizing, the targets) and PNGs (TTFT
p50/p99 against QPS per configuration; hit rate by tier per round) when matplotlib is there.
Targets (DESIGN.md): pressure regime mean TTFT with offload >= 3x better than without, at every
QPS; fits regime offload costs <= 5% mean TTFT.

    python -m benchmarks.multiturn_sweep --model-dir DIR --device cuda --qps 0.5,1,2,4 \\
        --regimes fits,pressure --users 32 --rounds 6 --system-prompt-len 2048 --history-len 4096
    python -m benchmarks.multiturn_sweep --model-dir /tmp/tiny --device cpu --qps 2,8 \\
        --users 8 --rounds 3 --system-prompt-len 200 --history-len 300 --answer-len 8   # smoke
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import queue
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from benchmarks import multiturn
from benchmarks.common import command, machine_info, now_iso, today, write_result
from benchmarks.sweep_report import evaluate_targets, plot, point_label, print_report
from benchmarks.workload import WorkloadConfig, words_text
from kvstore.cli_args import size_arg
from kvstore.testing.processes import stop_process

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class Process:
    """A subprocess whose merged output is drained by a thread (last lines kept)."""

    def __init__(self, cmd: list[str], name: str, keep: str | None = None) -> None:
        self.cmd = cmd
        self.name = name
        self.lines: collections.deque[str] = collections.deque(maxlen=200)
        self.error_lines: list[str] = []  # every ERROR or CRITICAL log line, kept in full
        self._keep = re.compile(keep) if keep else None
        self.kept: list[str] = []  # every line matching ``keep``, in full
        self._queue: queue.Queue[str | None] = queue.Queue()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if " ERROR " in line or " CRITICAL " in line:
                self.error_lines.append(line.rstrip("\n"))
            if self._keep is not None and self._keep.search(line):
                self.kept.append(line.rstrip("\n"))
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        """The first output line matching `pattern`; RuntimeError on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise RuntimeError(f"{self.name} not ready after {timeout_s:g} s:\n"
                                   + "\n".join(self.lines)) from None
            if line is None:
                raise RuntimeError(f"{self.name} exited with {self.proc.wait()}:\n"
                                   + "\n".join(self.lines))
            match = re.search(pattern, line)
            if match:
                return match

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
        stop_process(self.proc, sig, timeout_s)


def model_shape(model_dir: Path, block_size: int) -> tuple[int, int]:
    """(bytes of one KV block, max_position_embeddings) from config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    block_bytes = (2 * cfg["num_hidden_layers"] * kv_heads * head_dim * block_size
                   * _DTYPE_BYTES.get(str(dtype), 2))
    return block_bytes, int(cfg.get("max_position_embeddings") or 32768)


def tokens_per_word_of(model_dir: Path, seed: int) -> float | None:
    """Tokens per generated word with the model's own tokenizer (None without tokenizer.json)."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    text = words_text(random.Random(f"calibrate:{seed}"), 4000, 1.0)
    num_tokens = len(Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids)
    return num_tokens / len(text.split())


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def plan_sizing(args: argparse.Namespace, workload: WorkloadConfig, block_bytes: int,
                max_positions: int) -> dict:
    """HBM pool per regime, DRAM and max_model_len from the workload's estimated working set."""
    bs = args.block_size
    last = workload.last_prompt_len() + workload.answer_len
    max_model_len = args.max_model_len or min(max_positions, -(-int(last * 1.3 + 64) // bs) * bs)
    ctx_blocks = -(-max_model_len // bs)
    ws_tokens = workload.working_set_tokens()
    ws_blocks = -(-int(ws_tokens * 1.15) // bs)  # text lengths are approximate: a margin
    fits = args.fits_kv_blocks or max(int(ws_blocks * 1.5), 2 * ctx_blocks) + 16
    pressure = args.pressure_kv_blocks or max(math.ceil(ws_blocks / args.pressure_factor),
                                              ctx_blocks + 16)
    dram_bytes = args.dram or 2 * ws_blocks * block_bytes + 64 * 2**20
    host = _host_memory_bytes()
    if not args.dram and host:
        dram_bytes = min(dram_bytes, int(host * 0.6))
    notes = []
    if ws_blocks / pressure < 2:
        notes.append(f"pressure regime: working set only {ws_blocks / pressure:.1f}x the HBM "
                     "pool (raise --users or --history-len, or lower --pressure-kv-blocks)")
    if ws_blocks * block_bytes > dram_bytes:
        notes.append("the working set does not fit the daemon's DRAM: SSD or misses will count")
    if fits < ws_blocks:
        notes.append("fits regime: the HBM pool is smaller than the working set")
    return {"block_size": bs, "block_bytes": block_bytes, "max_model_len": max_model_len,
            "working_set_tokens_est": ws_tokens, "working_set_blocks_est": ws_blocks,
            "working_set_bytes_est": ws_blocks * block_bytes, "dram_bytes": int(dram_bytes),
            "regimes": {
                "fits": {"num_kv_blocks": fits, "working_set_over_hbm": ws_blocks / fits},
                "pressure": {"num_kv_blocks": pressure,
                             "working_set_over_hbm": ws_blocks / pressure}},
            "notes": notes}


def warm_up(url: str, max_tokens: int, tokens_per_word: float, length: int) -> None:
    """Two requests on text no user sends: kernels compiled, prefill rate measured."""
    rng = random.Random("warm-up")
    with httpx.Client(timeout=600) as client:
        for num_tokens in (16, length):
            body = {"messages": [{"role": "user",
                                  "content": words_text(rng, num_tokens, tokens_per_word)}],
                    "max_tokens": max_tokens, "temperature": 0.0}
            client.post(url + "/v1/chat/completions", json=body).raise_for_status()


def _daemon_stats(socket_path: Path) -> dict | None:
    try:
        from kvstore import Client

        with Client(str(socket_path), timeout_s=10.0) as c:
            stats = c.stats()
        return {"tiers": stats.get("tiers"), "counters": stats.get("counters")}
    except Exception as exc:  # stats are a nicety; the point's numbers stand without them
        return {"error": f"{type(exc).__name__}: {exc}"}


def _engine_offload_events(url: str) -> dict | None:
    """The engine's --kv-offload counters, scraped from its /metrics (a nicety, like above)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    events = {}
    for line in text.splitlines():
        if line.startswith(("kvengine:kv_offload_events_total{", "kvengine:kv_offload_in_flight{",
                            "kvengine:kv_offload_restore_estimate{")):
            labels, value = line.rsplit(" ", 1)
            key = 'event="' if 'event="' in labels else 'what="'
            name = labels.split(key, 1)[1].split('"', 1)[0]
            events[name] = float(value)
    return events


def run_point(args: argparse.Namespace, workload: WorkloadConfig, sizing: dict, regime: str,
              offload: bool, qps: float) -> dict:
    """Start the daemon (offload on) and the engine, run the workload, stop both."""
    point: dict = {"regime": regime, "offload": offload, "qps": qps,
                   "label": point_label(regime, offload),
                   "num_kv_blocks": sizing["regimes"][regime]["num_kv_blocks"], "error": None}
    workdir = Path(tempfile.mkdtemp(prefix="kv-sweep-"))  # 0700: the daemon's socket dir
    socket_path = workdir / "kv.sock"
    daemon = engine = None
    try:
        if offload:
            daemon = Process([sys.executable, "-m", "kvstore.cli", "serve", "--socket",
                               str(socket_path), "--dram", str(sizing["dram_bytes"]),
                               "--http", "off"], "kvstore serve")
            daemon.wait_for(r"kvstore: ready", args.start_timeout)
        cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(args.model_dir),
               "--device", args.device, "--port", "0", "--num-kv-blocks",
               str(point["num_kv_blocks"]), "--max-model-len", str(sizing["max_model_len"]),
               "--block-size", str(args.block_size), "--max-num-seqs",
               str(args.max_num_seqs or workload.num_users), *shlex.split(args.engine_args)]
        if offload:
            cmd += ["--kv-offload", "--kv-store-socket", str(socket_path),
                    "--kv-offload-policy", args.kv_offload_policy]
        point["engine_command"] = " ".join(cmd[1:])
        engine = Process(cmd, "kvengine serve")
        url = engine.wait_for(r"listening on (http://\S+)", args.start_timeout).group(1)
        warm_up(url, workload.answer_len, workload.tokens_per_word,
                 min(1024, sizing["max_model_len"] // 2))
        config = multiturn.RunConfig(url=url, workload=workload, qps=qps,
                                     request_timeout_s=args.request_timeout,
                                     duration_s=args.duration_s, progress=not args.no_progress)
        result = multiturn.run(config)
        point["summary"], point["records"] = result["summary"], result["records"]
        point["working_set_over_hbm_measured"] = _measured_pressure(
            result["records"], workload, point["num_kv_blocks"], args.block_size)
        if offload:
            point["daemon_stats"] = _daemon_stats(socket_path)
            point["engine_offload_events"] = _engine_offload_events(url)
    except Exception as exc:  # a point that cannot run is reported, the sweep goes on
        point["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
    finally:
        if engine is not None:
            engine.stop(signal.SIGINT)
            point["engine_exit_code"] = engine.proc.returncode
        if daemon is not None:
            daemon.stop(signal.SIGTERM)
        shutil.rmtree(workdir, ignore_errors=True)
    return point


def _measured_pressure(records: list[dict], workload: WorkloadConfig, num_kv_blocks: int,
                       block_size: int) -> float | None:
    """Users' total context (from the server's token counts, system prompt once) / HBM pool."""
    longest: dict[int, int] = {}
    for r in records:
        if r["prompt_tokens"] is not None:
            total = r["prompt_tokens"] + (r["completion_tokens"] or 0)
            longest[r["user"]] = max(longest.get(r["user"], 0), total)
    if not longest:
        return None
    shared = workload.system_prompt_len * (len(longest) - 1)
    return (sum(longest.values()) - shared) / block_size / num_kv_blocks


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m benchmarks.multiturn_sweep`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--qps", default="0.5,1,2,4", help="comma-separated arrival rates")
    p.add_argument("--regimes", default="fits,pressure")
    p.add_argument("--offload", default="on,off", help="which configurations: on, off or both")
    w = p.add_argument_group("workload (see benchmarks.multiturn)")
    w.add_argument("--users", type=int, default=16)
    w.add_argument("--rounds", type=int, default=4)
    w.add_argument("--system-prompt-len", type=int, default=1024)
    w.add_argument("--history-len", type=int, default=2048)
    w.add_argument("--question-len", type=int, default=24)
    w.add_argument("--answer-len", type=int, default=64)
    w.add_argument("--agentic", action="store_true")
    w.add_argument("--tool-result-len", type=int, default=1024)
    w.add_argument("--tokens-per-word", type=float, default=None,
                   help="default: measured with the model's tokenizer.json")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--request-timeout", type=float, default=300.0)
    w.add_argument("--duration-s", type=float, default=None, help="per point")
    s = p.add_argument_group("sizing (default: from the workload's estimated working set)")
    s.add_argument("--pressure-factor", type=float, default=4.0,
                   help="working set / HBM pool in the pressure regime")
    s.add_argument("--fits-kv-blocks", type=int, default=None)
    s.add_argument("--pressure-kv-blocks", type=int, default=None)
    s.add_argument("--dram", type=size_arg, default=None, help="daemon DRAM (e.g. 32GiB)")
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--max-num-seqs", type=int, default=None, help="default: --users")
    s.add_argument("--kv-offload-policy", choices=("write-through", "evict"),
                   default="write-through")
    s.add_argument("--engine-args", default="", help="more `kvengine serve` flags, one string")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None, help="name part of the files (default: DEVICE-MODEL)")
    return p


def _csv(text: str, allowed: tuple[str, ...], flag: str, parser: argparse.ArgumentParser) -> list:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if not items or bad:
        parser.error(f"{flag}: expected a comma-separated subset of {','.join(allowed)}")
    return items


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    regimes = _csv(args.regimes, ("fits", "pressure"), "--regimes", parser)
    offloads = [x == "on" for x in _csv(args.offload, ("on", "off"), "--offload", parser)]
    try:
        qps_list = [float(x) for x in args.qps.split(",") if x.strip()]
    except ValueError:
        parser.error("--qps: expected comma-separated numbers")
    if not qps_list or any(not q > 0 for q in qps_list):
        parser.error("--qps: every rate must be > 0")
    if not args.pressure_factor > 1:
        parser.error("--pressure-factor: the working set must be more than the HBM pool (> 1)")
    if not (args.model_dir / "config.json").exists():
        parser.error(f"--model-dir {args.model_dir}: no config.json")
    block_bytes, max_positions = model_shape(args.model_dir, args.block_size)
    tokens_per_word = args.tokens_per_word or tokens_per_word_of(args.model_dir, args.seed) or 1.3
    try:
        workload = WorkloadConfig(
            num_users=args.users, num_rounds=args.rounds, system_prompt_len=args.system_prompt_len,
            history_len=args.history_len, answer_len=args.answer_len,
            question_len=args.question_len, agentic=args.agentic,
            tool_result_len=args.tool_result_len, tokens_per_word=tokens_per_word,
            seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    sizing = plan_sizing(args, workload, block_bytes, max_positions)
    print(f"sizing: {json.dumps({k: v for k, v in sizing.items() if k != 'notes'})}")
    for note in sizing["notes"]:
        print(f"warning: {note}")

    points = []
    for regime in regimes:
        for offload in offloads:
            for qps in qps_list:
                print(f"\n== {point_label(regime, offload)}, qps {qps:g} "
                      f"({sizing['regimes'][regime]['num_kv_blocks']} KV blocks)", flush=True)
                point = run_point(args, workload, sizing, regime, offload, qps)
                if point["error"]:
                    print(f"point failed: {point['error']}", flush=True)
                else:
                    print(multiturn.format_summary(point["summary"]), flush=True)
                points.append(point)

    smoke = args.device == "cpu"
    result = {
        "benchmark": "multiturn_sweep",
        "smoke": smoke,
        "note": (f"CPU smoke run: checks the sweep end to end on {os.cpu_count()} CPU cores that "
                 "the client, engine and daemon share, where one point's numbers vary by several "
                 "x between repeats; they say nothing about the H100 targets" if smoke else None),
        "model_dir": str(args.model_dir), "device": args.device, "qps": qps_list,
        "regimes": regimes, "offload": offloads, "workload": asdict(workload), "sizing": sizing,
        "targets": evaluate_targets(points, qps_list),
        "machine": machine_info(), "date": now_iso(),
        "command": command("python -m benchmarks.multiturn_sweep", argv),
        "points": points,
    }
    print_report(result)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = args.tag or f"{args.device}-{args.model_dir.name}"
    stem = out_dir / f"multiturn_sweep-{tag}-{today()}"
    result["plots"] = plot(result, stem)
    write_result(out_dir, f"{stem.name}.json", result, indent=1, default=str)
    print(f"wrote {stem}.json" + "".join(f", {p}" for p in result["plots"]))
    return 0 if any(not p["error"] for p in points) else 1


if __name__ == "__main__":
    raise SystemExit(main())
