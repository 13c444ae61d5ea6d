"""A node of N GPUs behind ``kvengine router``: the long-context workload over N engines (issue 28).

The long-context preset's conversations (``benchmarks.multiturn.presets``: ~1k-token shared
system prompt, ~18k-token histories, 100-token answers), with N times its users and request
rate, sent to a ``kvengine router`` in front of N ``kvengine serve`` (one per device:
``cuda:0``..``cuda:N-1``, or N CPU engines), each engine's HBM pool a third of its share of the
users' contexts (``--hbm pressure``) or all of it (``--hbm fits``). Configurations, one after
another, each on fresh processes:

- ``rr-no-store`` (a): the router round-robin, engines without a store.
- ``rr-store`` (b): round-robin, one daemon shared by the engines.
- ``kv`` (c): ``--routing kv``, one shared daemon.
- ``single`` (d): one engine on one device with one engine's share of the load (the preset's
  users and rate) and an HBM pool that holds it all: the bound later turns are held to.

Reported per configuration: mean TTFT of all, first and later turns, p50/p90/p99, hit tokens by
tier, and the router's requests by reason (from its ``/metrics``); then the issue's ratios:
(c) later turns against (d) (target <= 1.3x) and against (a) (>= 4x better), (c) against (b) at
p50 of later turns (>= 1.5x), (b) against (a) (>= 3x). JSON to ``--out``.

    python -m benchmarks.node --model-dir DIR --device cuda --gpus 2 [--duration-s 60]
    python -m benchmarks.node --model-dir /tmp/tiny --device cpu --gpus 2 --scale 0.02 \\
        --users 4 --qps 8 --duration-s 5 --configs kv,single   # CPU smoke only

Configurations are independent: on a host with more GPUs, run them side by side, each its own
``--configs`` (``../shared/tools/gpu-jobs``), then join their files into one result and its
ratios with ``python -m benchmarks.node --merge A.json B.json ... [--tag T] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import httpx

from benchmarks.common import command, machine_info, now_iso, today, write_result
from benchmarks.multiturn import load
from benchmarks.multiturn.chat_client import add_client_arg
from benchmarks.multiturn.presets import PRESETS, scaled, summarize_point
from benchmarks.node_plot import plot_ttft
from benchmarks.node_routes import decisions, router_reasons, routing_stages
from benchmarks.servers import ServerProcess, warm_up
from benchmarks.sizing import model_shape, plan_sizing, tokens_per_word_of
from kvstore.cli.args import size_arg
from server.router.request_router import ROUTE_LOG_PREFIX

CONFIGS = ("rr-no-store", "rr-store", "kv", "single")
TARGETS = {"kv_later_vs_single": 1.3, "kv_later_vs_rr_no_store": 4.0,
           "kv_vs_rr_store_later_p50": 1.5, "rr_store_vs_rr_no_store_later": 3.0,
           "kv_vs_rr_store_all": 1.0, "kv_vs_rr_store_first": 1.0, "kv_vs_rr_store_p90": 1.0,
           "kv_vs_rr_store_p99": 1.0}


def _engine_cmd(args: argparse.Namespace, device: str, num_kv_blocks: int, sizing: dict,
                max_num_seqs: int, socket_path: Path | None) -> list[str]:
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(args.model_dir),
           "--device", device, "--port", "0", "--num-kv-blocks", str(num_kv_blocks),
           "--max-model-len", str(sizing["max_model_len"]), "--block-size", str(args.block_size),
           "--max-num-seqs", str(max_num_seqs)]
    if socket_path is not None:
        cmd += ["--kv-offload", "--kv-store-socket", str(socket_path)]
    return cmd


# kvengine:kv_offload_events_total{...,event="restores_declined"} 3.0
_OFFLOAD_EVENT = re.compile(r'kvengine:kv_offload_events_total\{.*event="(\w+)".*\}\s+([0-9.e+]+)')


def _offload_events(url: str) -> dict[str, float]:
    """An engine's --kv-offload event counts (restores by how they ended, lookups answered
    late, loads...), from its /metrics."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return {}
    return {m.group(1): float(m.group(2)) for m in map(_OFFLOAD_EVENT.match, text.splitlines())
            if m and float(m.group(2))}


def run_config(args: argparse.Namespace, config: str, workload, qps: float, sizing: dict,
               block_bytes: int) -> dict:
    """Start the daemon, engines and router of ``config``, run the workload, stop them."""
    single = config == "single"
    num_engines = 1 if single else args.gpus
    blocks = sizing["fits_blocks"] if single or args.hbm == "fits" else \
        sizing["pressure_blocks"]
    point: dict = {"config": config, "engines": num_engines, "num_kv_blocks": blocks,
                   "qps": qps, "error": None}
    workdir = Path(tempfile.mkdtemp(prefix="kv-node-"))
    socket_path = workdir / "kv.sock" if config != "rr-no-store" else None
    procs: list[ServerProcess] = []
    try:
        if socket_path is not None:
            daemon = ServerProcess(
                [sys.executable, "-m", "kvstore.cli", "serve", "--socket", str(socket_path),
                 "--dram", str(sizing["dram_bytes"]), "--http", "off"], "kvstore serve")
            procs.append(daemon)
            daemon.wait_for(r"kvstore: ready", args.start_timeout)
        urls = []
        for i in range(num_engines):
            device = f"cuda:{i}" if args.device == "cuda" else "cpu"
            engine = ServerProcess(
                _engine_cmd(args, device, blocks, sizing, workload.num_users, socket_path),
                f"kvengine serve ({device})")
            procs.append(engine)
            urls.append(engine.wait_for(r"listening on (http://\S+)", args.start_timeout)
                        .group(1))
        for url in urls:
            warm_up(url, workload.answer_len, workload.tokens_per_word,
                    min(1024, sizing["max_model_len"] // 2))
        url = urls[0]
        if not single:
            routing = "kv" if config == "kv" else "round-robin"
            cmd = [sys.executable, "-m", "server.cli", "router", str(args.model_dir),
                   "--routing", routing, "--port", "0", "--log-level", "debug",
                   "--uvicorn-log-level", "warning", "--engine-header", "url"]
            for engine_url in urls:
                cmd += ["--engine", engine_url]
            if socket_path is not None:
                cmd += ["--kv-store-socket", str(socket_path)]
            router = ServerProcess(cmd, "kvengine router",
                                   keep=re.escape(ROUTE_LOG_PREFIX) + r"\{")
            procs.append(router)
            url = router.wait_for(r"listening on (http://\S+)", args.start_timeout).group(1)
        run = load.RunConfig(url=url, workload=workload, qps=qps,
                             request_timeout_s=args.request_timeout,
                             duration_s=args.duration_s, progress=not args.no_progress,
                             client=args.client)
        result = load.run(run)
        point["records"] = result["records"]
        point["summary"] = _figures(result, block_bytes / args.block_size, args.h2d_gbps)
        if socket_path is not None:
            point["engine_offload_events"] = {u: _offload_events(u) for u in urls}
        if not single:
            point["router_requests_by_reason"] = router_reasons(url)
            point["routes"] = decisions(router.kept)
            point["routing_stages_ms"] = routing_stages(point["routes"])
    except Exception as exc:  # a configuration that cannot run is reported, the rest go on
        point["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
    finally:
        for proc in reversed(procs):
            proc.stop(signal.SIGINT)
        shutil.rmtree(workdir, ignore_errors=True)
        if socket_path is not None and procs:  # the target: zero copy errors in every config
            point["daemon_error_lines"] = len(procs[0].error_lines)
            point["daemon_error_sample"] = procs[0].error_lines[:5]
    return point


def _figures(result: dict, kv_bytes_per_token: float, h2d_gbps: float) -> dict:
    """Mean TTFT of all, first and later turns (ms), later turns' p50, and the preset's
    summary (hits by tier, restores against their floor)."""
    full = summarize_point(result, kv_bytes_per_token, h2d_gbps)
    later = sorted(r["ttft_s"] for r in result["records"] if r["error"] is None and r["round"])
    ttft = full["ttft_ms"]
    return {"all_ms": ttft["mean_all"], "first_ms": ttft["mean_first_turns"],
            "later_ms": ttft["mean_later_turns"],
            "later_p50_ms": later[len(later) // 2] * 1e3 if later else None,
            "p90_ms": ttft["p90"], "p99_ms": ttft["p99"], "num_ok": full["num_ok"],
            "num_requests": full["num_requests"], "hits": full["hits"],
            "restores": full["restores"]}


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def compare(points: dict[str, dict]) -> dict:
    """The issue's ratios between configurations (None where one is missing)."""
    def get(config: str, key: str) -> float | None:
        point = points.get(config)
        return (point or {}).get("summary", {}).get(key) if point and not point["error"] \
            else None

    return {
        "kv_later_vs_single": _ratio(get("kv", "later_ms"), get("single", "later_ms")),
        "kv_later_vs_rr_no_store": _ratio(get("rr-no-store", "later_ms"), get("kv", "later_ms")),
        "kv_vs_rr_store_later_p50": _ratio(get("rr-store", "later_p50_ms"),
                                           get("kv", "later_p50_ms")),
        "rr_store_vs_rr_no_store_later": _ratio(get("rr-no-store", "later_ms"),
                                                get("rr-store", "later_ms")),
        # (c) no worse than (b): (b) over (c) of each statistic, at least 1
        **{f"kv_vs_rr_store_{key[:-3]}": _ratio(get("rr-store", key), get("kv", key))
           for key in ("all_ms", "first_ms", "p90_ms", "p99_ms")},
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path)
    p.add_argument("--device", choices=("cuda", "cpu"))
    p.add_argument("--plot", action="store_true",
                   help="--merge: also a PNG of TTFT over the run per configuration")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON[:CONFIG,...]",
                   help="join the points of earlier runs' result files (all their "
                   "configurations, or those named after a colon) into one result with the "
                   "ratios, and run nothing")
    p.add_argument("--gpus", type=int, default=2, help="engines of the node (one per device)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--scale", type=float, default=1.0, help="multiply every length (CPU runs)")
    p.add_argument("--duration-s", type=float, default=60.0, help="per configuration")
    p.add_argument("--users", type=int, default=None, help="per engine (default: the preset's)")
    p.add_argument("--qps", type=float, default=None, help="per engine (default: the preset's)")
    p.add_argument("--dram", type=size_arg, default=None)
    p.add_argument("--hbm", choices=("pressure", "fits"), default="pressure",
                   help="each node engine's KV pool: pressure, a third of its share of the "
                   "users' contexts (the node's HBM holds a third: most later turns restore "
                   "from DRAM whatever the routing); fits, its whole share, as (d)'s (the "
                   "node's HBM holds everything: a later turn is an own-HBM hit only where "
                   "its conversation went before)")
    p.add_argument("--h2d-gbps", type=float, default=50.0,
                   help="the restore floor's bandwidth in the summaries")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--no-progress", action="store_true")
    add_client_arg(p)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None)
    return p


def _print_ratios(ratios: dict) -> None:
    for key, value in ratios.items():
        target = TARGETS[key]
        met = None if value is None else (value <= target if key == "kv_later_vs_single"
                                          else value >= target)
        print(f"{key}: {value if value is None else round(value, 3)} (target "
              f"{'<=' if key == 'kv_later_vs_single' else '>='} {target}: "
              f"{'n/a' if met is None else 'met' if met else 'missed'})")


def merge(args: argparse.Namespace, argv: list[str] | None) -> int:
    """One result from several runs' files: their points side by side, the ratios between."""

    runs, points = [], {}
    for spec in args.merge:
        path, _, wanted = str(spec).partition(":")
        run = json.loads(Path(path).read_text())
        runs.append(run)
        taken = wanted.split(",") if wanted else list(run["points"])
        for config in taken:
            if config not in run["points"]:
                raise SystemExit(f"--merge: {path} has no configuration {config}")
            if config in points:
                raise SystemExit(f"--merge: configuration {config} is in two files")
            points[config] = run["points"][config]
    ratios = compare(points)
    _print_ratios(ratios)
    first = runs[0]
    out = {**{k: first.get(k) for k in ("benchmark", "device", "gpus", "hbm", "sizing",
                                          "per_engine_users", "machine")},
           "points": points, "ratios": ratios, "targets": TARGETS,
           "merged_from": [run.get("command") for run in runs], "date": now_iso(),
           "command": command("python -m benchmarks.node", argv)}
    tag = args.tag or f"{first.get('device')}-{first.get('gpus')}x"
    print(f"wrote {write_result(args.out, f'node-{tag}-{today()}.json', out)}")
    if args.plot:
        png = Path(args.out) / f"node-{tag}-{today()}.png"
        print(f"wrote {plot_ttft(points, CONFIGS, png, tag)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args, argv)
    if args.model_dir is None or args.device is None:
        parser.error("--model-dir and --device are required (unless --merge)")
    configs = [c for c in args.configs.split(",") if c]
    if not configs or set(configs) - set(CONFIGS):
        parser.error(f"--configs: some of {', '.join(CONFIGS)}")
    if args.gpus < 1:
        parser.error("--gpus must be at least 1")
    if not (args.model_dir / "config.json").exists():
        parser.error(f"--model-dir {args.model_dir}: no config.json")
    preset = PRESETS["long-context"]
    block_bytes, max_positions = model_shape(args.model_dir, args.block_size)
    per_engine = scaled(preset["workload"], args.scale)
    per_engine = replace(per_engine,
                         tokens_per_word=tokens_per_word_of(args.model_dir, 0) or 1.3,
                         num_users=args.users or per_engine.num_users)
    engine_qps = args.qps or preset["qps"]
    node = replace(per_engine, num_users=per_engine.num_users * args.gpus)
    plan = plan_sizing(per_engine, block_bytes, max_positions, block_size=args.block_size,
                       pressure_factor=preset["pressure_factor"],
                       max_model_len=args.max_model_len, dram_bytes=args.dram)
    ws = plan["working_set_blocks_est"]
    sizing = {"max_model_len": plan["max_model_len"],
              "pressure_blocks": plan["regimes"]["pressure"]["num_kv_blocks"],
              "fits_blocks": max(int(ws * 1.1) + 16,
                                 -(-plan["max_model_len"] // args.block_size)),
              # the node's DRAM holds every engine's share
              "dram_bytes": args.dram or plan["dram_bytes"] * args.gpus}
    points: dict[str, dict] = {}
    for config in configs:
        single = config == "single"
        workload, qps = (per_engine, engine_qps) if single else (node, engine_qps * args.gpus)
        print(f"\n== node: {config} ({1 if single else args.gpus} engines, {workload.num_users} "
              f"users, {qps:g} req/s)", flush=True)
        points[config] = run_config(args, config, workload, qps, sizing, block_bytes)
        point = points[config]
        if point["error"]:
            print(f"  failed: {point['error']}", flush=True)
        else:
            s = point["summary"]
            print(f"  all {s.get('all_ms')} ms, first {s.get('first_ms')} ms, later "
                  f"{s.get('later_ms')} ms (p50 {s.get('later_p50_ms')}); routed "
                  f"{point.get('router_requests_by_reason', {})}; daemon error lines "
                  f"{point.get('daemon_error_lines')}", flush=True)
    ratios = compare(points)
    _print_ratios(ratios)
    tag = args.tag or f"{args.device}-{args.gpus}x"
    out = {"benchmark": "node", "device": args.device, "gpus": args.gpus, "hbm": args.hbm,
           "sizing": sizing,
           "per_engine_users": per_engine.num_users, "points": points, "ratios": ratios,
           "targets": TARGETS, "machine": machine_info(), "date": now_iso(),
           "command": command("python -m benchmarks.node", argv)}
    print(f"wrote {write_result(args.out, f'node-{tag}-{today()}.json', out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
