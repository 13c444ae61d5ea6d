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

    python -m benchmarks.multiturn.sweep --model-dir DIR --device cuda --qps 0.5,1,2,4 \\
        --regimes fits,pressure --users 32 --rounds 6 --system-prompt-len 2048 --history-len 4096
    python -m benchmarks.multiturn.sweep --model-dir /tmp/tiny --device cpu --qps 2,8 \\
        --users 8 --rounds 3 --system-prompt-len 200 --history-len 300 --answer-len 8   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import command, machine_info, now_iso, today, write_result
from benchmarks.multiturn import load, server_timing
from benchmarks.multiturn.chat_client import add_client_arg
from benchmarks.multiturn.summary import format_summary
from benchmarks.multiturn.sweep_report import evaluate_targets, plot, point_label, print_report
from benchmarks.servers import ServerProcess, warm_up
from benchmarks.sizing import model_shape, plan_sizing, tokens_per_word_of
from benchmarks.workload import WorkloadConfig
from kvstore.cli.args import size_arg


@dataclass(frozen=True)
class PointSetup:
    """How a point's daemon and engine start and its load runs: the flags that the sweep and the
    presets (``benchmarks.multiturn.presets``) share."""

    model_dir: Path
    device: str
    block_size: int
    max_num_seqs: int | None  # None: the workload's user count
    kv_offload_policy: str
    engine_args: str  # more `kvengine serve` flags, one string
    start_timeout_s: float
    request_timeout_s: float
    duration_s: float | None
    progress: bool
    client: str  # the load's chat client (chat_client.CLIENTS)
    plan_cache: str = "per-point"  # PLAN_CACHES
    daemon_args: str = ""  # more `kvstore serve` flags, one string (offload on)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PointSetup:
        """From the parsed flags of the sweep or of the presets."""
        return cls(model_dir=args.model_dir, device=args.device, block_size=args.block_size,
                   max_num_seqs=args.max_num_seqs, kv_offload_policy=args.kv_offload_policy,
                   engine_args=args.engine_args, start_timeout_s=args.start_timeout,
                   request_timeout_s=args.request_timeout, duration_s=args.duration_s,
                   progress=not args.no_progress, client=args.client,
                   plan_cache=args.plan_cache, daemon_args=args.daemon_args)


PLAN_CACHES = ("per-point", "machine")


def add_plan_cache_arg(parser: argparse.ArgumentParser) -> None:
    """``--plan-cache``, as the sweep and the presets take it."""
    parser.add_argument("--plan-cache", choices=PLAN_CACHES, default="per-point",
                        help="per-point: each configuration's engine starts with an empty cuDNN "
                        "plan cache of its own (neither inherits the graphs the other built, "
                        "or their shapes, loaded before ready on a warm start); machine: the "
                        "user's cache, as a production restart")


def _daemon_stats(socket_path: Path) -> dict | None:
    try:
        from kvstore import Client

        with Client(str(socket_path), timeout_s=10.0) as c:
            stats = c.stats()
        daemon = stats.get("daemon") or {}
        # the daemon's own side: its events (lookup_load's lookup/load split, in µs), each
        # timed verb's count and total request time (received to reply sent), and where its
        # saves' and loads' copies spent their time (copy_ms: phases summed, GPU only) and
        # how they went (copies: blocks asked for and the copies made of them, GPU only)
        return {"tiers": stats.get("tiers"), "counters": stats.get("counters"),
                "events": daemon.get("events"), "request_ms": daemon.get("request_ms"),
                "copy_ms": daemon.get("copy_ms"), "copies": daemon.get("copies")}
    except Exception as exc:  # stats are a nicety; the point's numbers stand without them
        return {"error": f"{type(exc).__name__}: {exc}"}


def _engine_offload_events(text: str) -> dict:
    """The engine's --kv-offload counters, the server's TTFT by source (``server_ttft_*``) and
    its preemptions (``num_preemptions``: prompts computed again), from its /metrics text."""
    events = {}
    for line in text.splitlines():
        if line.startswith(("kvengine:kv_offload_events_total{", "kvengine:kv_offload_in_flight{",
                            "kvengine:kv_offload_restore_estimate{")):
            labels, value = line.rsplit(" ", 1)
            key = 'event="' if 'event="' in labels else 'what="'
            name = labels.split(key, 1)[1].split('"', 1)[0]
            events[name] = float(value)
        elif line.startswith(("kvengine:time_to_first_token_by_source_seconds_sum{",
                              "kvengine:time_to_first_token_by_source_seconds_count{")):
            labels, value = line.rsplit(" ", 1)  # the server's TTFT (from arrival), by source
            source = labels.split('source="', 1)[1].split('"', 1)[0]
            what = "s_sum" if "_sum{" in labels else "count"
            events[f"server_ttft_{what}_{source}"] = float(value)
        elif line.startswith("vllm:num_preemptions_total"):
            events["num_preemptions"] = float(line.rsplit(" ", 1)[1])
    return events


def attention_backend(metrics_text: str) -> str | None:
    """Which attention the engine ran (``prefill=cudnn decode=cudnn``), from its /metrics
    (``kvengine:attention_backend_info``), None when it is not there. A run whose GPU image
    lacked cuDNN's frontend ran every phase with our kernels (agent turns' TTFT 1.5-1.7x,
    inter-token latency 1.2x: README, s21), and the engine said so only in its own log."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "kvengine:attention_backend_info":
            for sample in family.samples:
                return " ".join(f"{phase}={sample.labels[phase]}"
                                for phase in ("prefill", "decode") if phase in sample.labels)
    return None


def _scrape_engine(point: dict, url: str) -> None:
    """The point's ``engine_offload_events`` and ``attention_backend`` from the engine's
    /metrics (a nicety, like the daemon's stats: the numbers stand without them)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except Exception as exc:
        point["engine_offload_events"] = {"error": f"{type(exc).__name__}: {exc}"}
        return
    point["engine_offload_events"] = _engine_offload_events(text)
    point["attention_backend"] = attention_backend(text)


def run_point(setup: PointSetup, workload: WorkloadConfig, sizing: dict, regime: str,
              offload: bool, qps: float) -> dict:
    """Start the daemon (offload on) and the engine, run the workload, stop both."""
    point: dict = {"regime": regime, "offload": offload, "qps": qps,
                   "label": point_label(regime, offload),
                   "num_kv_blocks": sizing["regimes"][regime]["num_kv_blocks"], "error": None}
    workdir = Path(tempfile.mkdtemp(prefix="kv-sweep-"))  # 0700: the daemon's socket dir
    socket_path = workdir / "kv.sock"
    timing_log = workdir / "request-timing.jsonl"  # each request's phases (server_timing)
    daemon = engine = None
    try:
        if offload:
            daemon = ServerProcess([sys.executable, "-m", "kvstore.cli", "serve", "--socket",
                                    str(socket_path), "--dram", str(sizing["dram_bytes"]),
                                    "--http", "off", *shlex.split(setup.daemon_args)],
                                   "kvstore serve")
            daemon.wait_for(r"kvstore: ready", setup.start_timeout_s)
        cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(setup.model_dir),
               "--device", setup.device, "--port", "0", "--num-kv-blocks",
               str(point["num_kv_blocks"]), "--max-model-len", str(sizing["max_model_len"]),
               "--block-size", str(setup.block_size), "--max-num-seqs",
               str(setup.max_num_seqs or workload.num_users), "--request-timing-log",
               str(timing_log), *shlex.split(setup.engine_args)]
        if offload:
            cmd += ["--kv-offload", "--kv-store-socket", str(socket_path),
                    "--kv-offload-policy", setup.kv_offload_policy]
        point["engine_command"] = " ".join(cmd[1:])
        env = ({"KVSTORE_CUDNN_PLAN_CACHE": str(workdir / "cudnn-plans")}
               if setup.plan_cache == "per-point" else {})
        point["engine_env"] = env
        # every build a request waited for after ready (kernels/build_log.py), kept in full
        engine = ServerProcess(cmd, "kvengine serve", keep=r"first-use build", env=env)
        url = engine.wait_for(r"listening on (http://\S+)", setup.start_timeout_s).group(1)
        warm_up(url, workload.answer_len, workload.tokens_per_word,
                min(1024, sizing["max_model_len"] // 2))
        config = load.RunConfig(url=url, workload=workload, qps=qps,
                                request_timeout_s=setup.request_timeout_s,
                                duration_s=setup.duration_s, progress=setup.progress,
                                client=setup.client)
        result = load.run(config)
        point["summary"], point["records"] = result["summary"], result["records"]
        point["num_server_timed"] = server_timing.join(point["records"], timing_log)
        point["working_set_over_hbm_measured"] = _measured_pressure(
            result["records"], workload, point["num_kv_blocks"], setup.block_size)
        if offload:
            point["daemon_stats"] = _daemon_stats(socket_path)
        # offload off has no offload counters, but the server's TTFT by source is there too
        _scrape_engine(point, url)
    except Exception as exc:  # a point that cannot run is reported, the sweep goes on
        point["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
    finally:
        if engine is not None:
            engine.stop(signal.SIGINT)
            point["engine_exit_code"] = engine.proc.returncode
            point["first_use_builds"] = engine.kept
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
    """The argument parser of `python -m benchmarks.multiturn.sweep`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--qps", default="0.5,1,2,4", help="comma-separated arrival rates")
    p.add_argument("--regimes", default="fits,pressure")
    p.add_argument("--offload", default="on,off", help="which configurations: on, off or both")
    w = p.add_argument_group("workload (see benchmarks.multiturn.load)")
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
    s.add_argument("--daemon-args", default="",
                   help="more `kvstore serve` flags, one string (offload on)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--no-progress", action="store_true")
    add_client_arg(p)
    add_plan_cache_arg(p)
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
    sizing = plan_sizing(workload, block_bytes, max_positions, block_size=args.block_size,
                         pressure_factor=args.pressure_factor, max_model_len=args.max_model_len,
                         fits_kv_blocks=args.fits_kv_blocks,
                         pressure_kv_blocks=args.pressure_kv_blocks, dram_bytes=args.dram)
    print(f"sizing: {json.dumps({k: v for k, v in sizing.items() if k != 'notes'})}")
    for note in sizing["notes"]:
        print(f"warning: {note}")

    setup = PointSetup.from_args(args)
    points = []
    for regime in regimes:
        for offload in offloads:
            for qps in qps_list:
                print(f"\n== {point_label(regime, offload)}, qps {qps:g} "
                      f"({sizing['regimes'][regime]['num_kv_blocks']} KV blocks)", flush=True)
                point = run_point(setup, workload, sizing, regime, offload, qps)
                if point["error"]:
                    print(f"point failed: {point['error']}", flush=True)
                else:
                    print(format_summary(point["summary"]), flush=True)
                points.append(point)

    smoke = args.device == "cpu"
    result = {
        "benchmark": "multiturn_sweep",
        "smoke": smoke,
        "note": (f"CPU smoke run: checks the sweep end to end on {os.cpu_count()} CPU cores that "
                 "the client, engine and daemon share, where one point's numbers vary by several "
                 "x between repeats; they say nothing about the H100 targets" if smoke else None),
        "model_dir": str(args.model_dir), "device": args.device, "qps": qps_list,
        "regimes": regimes, "offload": offloads, "plan_cache": args.plan_cache,
        "workload": asdict(workload), "sizing": sizing,
        "targets": evaluate_targets(points, qps_list),
        "machine": machine_info(), "date": now_iso(),
        "command": command("python -m benchmarks.multiturn.sweep", argv),
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
