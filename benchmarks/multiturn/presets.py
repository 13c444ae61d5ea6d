"""Multi-turn presets of issue 18, offload on against off in one run: long-context chat, agents.

- ``long-context``: 15 users over a ~1k-token shared system prompt, ~18k-token histories,
  100-token answers, 0.5 requests/s; the HBM pool holds about a third of the users' contexts
  (``--pressure-factor 3``), the daemon's DRAM holds all of it.
- ``agentic``: tool-call loops: 8 agents over a ~1k-token system prompt (tool definitions), a
  ~2k-token task, then every step brings a ~300-token tool result and a short question and gets a
  32-token answer (a tool call); 10 steps, 1 request/s; same HBM/DRAM sizing.
- ``agent-tools`` (issue 31): many short tool-call turns: 16 agents over a ~4k-token system
  prompt (the tool schemas an agent framework sends), a ~512-token task, then 24 steps each
  bringing a ~160-token tool result and an 8-token nudge and getting a 24-token answer (a tool
  call); 2 requests/s so the agents' steps interleave; HBM holds about a third of them. The
  schemas and calls are stand-in text (the requests send no ``tools``): this measures the KV
  reuse of the agent loop; ``benchmarks.structured_step`` measures the grammar's cost.

Each configuration runs on a fresh ``kvstore serve`` (offload on) and ``kvengine serve``
(``benchmarks.multiturn.sweep.run_point``). Reported per configuration: mean TTFT over all turns,
first turns (cold either way) and later turns; TTFT p50/p90/p99; inter-token latency p50/p99;
hit rate by tier; for restored turns the load floor (restored KV bytes / ``--h2d-gbps``) and how
far above it each restore's TTFT sits. Against each preset's targets (``targets.py``: issue 18's,
and issue 36's for agent-tools); with ``--regimes pressure,fits`` also the fits-in-HBM overhead
(<= 3%). JSON and a TTFT-over-time PNG (on against off) go to --out.

``--scale`` shrinks every length (not the user count) for CPU runs with a tiny model:

    python -m benchmarks.multiturn.presets --preset long-context --model-dir DIR --device cuda
    python -m benchmarks.multiturn.presets --preset agentic --model-dir /tmp/tiny --device cpu \\
        --scale 0.05 --users 4 --rounds 3 --qps 20       # CPU smoke: says nothing about H100
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.common import (
    command,
    machine_info,
    now_iso,
    percentile,
    raw_h2d_gbps,
    today,
    write_result,
)
from benchmarks.multiturn.chat_client import add_client_arg
from benchmarks.multiturn.server_timing import mean_phases, mean_queued_parts
from benchmarks.multiturn.summary import fmt_num
from benchmarks.multiturn.sweep import PointSetup, add_plan_cache_arg, run_point
from benchmarks.multiturn.targets import PRESET_TARGETS, compare, first_minute_max_ttft_ms
from benchmarks.sizing import model_shape, plan_sizing, tokens_per_word_of
from benchmarks.workload import WorkloadConfig
from kvstore.cli.args import positive_float_arg, size_arg

PRESETS: dict[str, dict] = {
    "long-context": dict(
        workload=WorkloadConfig(num_users=15, num_rounds=4, system_prompt_len=1024,
                                history_len=18000, answer_len=100, question_len=48),
        qps=0.5, pressure_factor=3.0),
    "agentic": dict(
        workload=WorkloadConfig(num_users=8, num_rounds=10, system_prompt_len=1024,
                                history_len=2048, answer_len=32, question_len=16, agentic=True,
                                tool_result_len=300),
        qps=1.0, pressure_factor=3.0),
    "agent-tools": dict(
        workload=WorkloadConfig(num_users=16, num_rounds=24, system_prompt_len=4096,
                                history_len=512, answer_len=24, question_len=8, agentic=True,
                                tool_result_len=160),
        qps=2.0, pressure_factor=3.0),
}
# Raw pinned host-to-device bandwidth, the restore floor: measured in the run on CUDA; this
# figure (one H100, DESIGN.md) stands in for CPU runs and says so in the result.
DEFAULT_H2D_GBPS = 50.3
HBM_HIT_SHARE = 0.9  # a later turn with this share of its prompt in HBM counts as an HBM hit
RESTORE_FLOOR_FACTOR = 1.1  # issue 18: a restore <= 1.1 x (KV bytes / raw H2D) + HBM-hit TTFT


def scaled(workload: WorkloadConfig, scale: float) -> WorkloadConfig:
    """Every length times ``scale`` (a few tokens at least); users and rounds unchanged."""
    if not 0 < scale <= 1:
        raise ValueError("scale must be in (0, 1]")

    def s(n: int, least: int) -> int:
        return max(least, round(n * scale)) if n else 0

    return replace(workload, system_prompt_len=s(workload.system_prompt_len, 8),
                   history_len=s(workload.history_len, 16), answer_len=s(workload.answer_len, 4),
                   question_len=s(workload.question_len, 4),
                   tool_result_len=s(workload.tool_result_len, 8))


def _ms(values: list[float]) -> float | None:
    return statistics.fmean(values) * 1e3 if values else None


def _p(values: list[float], q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else value * 1e3


def summarize_point(point: dict, kv_bytes_per_token: float, h2d_gbps: float,
                    hbm_hit_ms: float | None = None) -> dict:
    """The issue's figures for one configuration, from its records."""
    ok = [r for r in point["records"] if r["error"] is None]
    ttft = [r["ttft_s"] for r in ok]
    first = [r["ttft_s"] for r in ok if r["round"] == 0]
    later = [r["ttft_s"] for r in ok if r["round"] > 0]
    itl = [x for r in ok for x in r["itl_s"]]
    restores = []
    for r in ok:
        tiers = r["cached_tokens_by_tier"] or {}
        restored = sum(tiers.get(t, 0) for t in ("dram", "ssd", "remote"))
        if r["round"] > 0 and restored:
            floor_s = restored * kv_bytes_per_token / (h2d_gbps * 1e9)
            restores.append({"ttft_ms": r["ttft_s"] * 1e3, "load_floor_ms": floor_s * 1e3,
                             "restored_tokens": restored, "record": r})
    over = [x["ttft_ms"] - x["load_floor_ms"] for x in restores]
    # The issue's bound for a restored turn: 1.1 x its load floor + an HBM-hit turn's TTFT. HBM
    # hits of this run: later turns that found nearly all their prompt in the engine (a hit on the
    # shared system prompt alone is a recompute). Under pressure there are few or none, and they
    # queue like the rest: ``hbm_hit_ms`` (an idle engine's, from benchmarks.serve) replaces them.
    hbm_hit_records = [r for r in ok if r["round"] > 0 and r.get("prompt_tokens")
                       and (r["cached_tokens_by_tier"] or {}).get("hbm", 0)
                       >= HBM_HIT_SHARE * r["prompt_tokens"]]
    hbm_hits = [r["ttft_s"] * 1e3 for r in hbm_hit_records]
    hbm_hit_ms = hbm_hit_ms if hbm_hit_ms is not None else percentile(hbm_hits, 0.5)
    bound_ratios = ([x["ttft_ms"] / (RESTORE_FLOOR_FACTOR * x["load_floor_ms"] + hbm_hit_ms)
                     for x in restores] if hbm_hit_ms is not None else [])
    return {
        "num_ok": len(ok), "num_requests": len(point["records"]),
        "ttft_ms": {"mean_all": _ms(ttft), "mean_first_turns": _ms(first),
                    "mean_later_turns": _ms(later), "p50": _p(ttft, 0.5), "p90": _p(ttft, 0.9),
                    "p99": _p(ttft, 0.99), "max_first_minute": first_minute_max_ttft_ms(ok)},
        "itl_ms": {"p50": _p(itl, 0.5), "p99": _p(itl, 0.99)},
        # where TTFT went (the server's timing log); the run's very first request (a cold
        # machine's, either configuration) left out of the first turns
        "server_phases_ms": {
            "first_turns": mean_phases([r for r in ok[1:] if r["round"] == 0]),
            "later_turns": mean_phases([r for r in ok if r["round"] > 0]),
            # the queued phase of restored turns and of HBM hits, cut where the engine stamped
            "restored_turns_queued": mean_queued_parts([x["record"] for x in restores]),
            "hbm_hit_turns_queued": mean_queued_parts(hbm_hit_records)},
        "hits": point["summary"]["hits"],
        "restores": {"num": len(restores),
                     "load_floor_ms_mean": (statistics.fmean(x["load_floor_ms"] for x in restores)
                                            if restores else None),
                     "ttft_over_floor_ms_p50": percentile(over, 0.5),
                     "ttft_over_floor_ms_mean": statistics.fmean(over) if over else None,
                     "hbm_hit_ttft_ms_p50": hbm_hit_ms, "num_hbm_hits": len(hbm_hits),
                     "ttft_over_bound_p50": percentile(bound_ratios, 0.5),
                     "ttft_over_bound_p90": percentile(bound_ratios, 0.9),
                     "share_within_bound": (sum(b <= 1.0 for b in bound_ratios)
                                            / len(bound_ratios) if bound_ratios else None)},
    }


def plot_ttft_over_time(result: dict, path: Path) -> str | None:
    """TTFT of every request against its send time, on against off; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    regimes = sorted({p["regime"] for p in result["points"]})
    fig, axes = plt.subplots(len(regimes), 1, figsize=(10, 3.8 * len(regimes)), squeeze=False)
    for ax, regime in zip(axes[:, 0], regimes):
        for p in result["points"]:
            if p["regime"] != regime or p["error"]:
                continue
            color = "tab:green" if p["offload"] else "tab:red"
            for first, marker in ((True, "x"), (False, "o")):
                rows = [(r["sent_s"], r["ttft_s"] * 1e3) for r in p["records"]
                        if r["error"] is None and (r["round"] == 0) == first]
                ax.scatter([x for x, _ in rows], [y for _, y in rows], s=14, marker=marker,
                           color=color, alpha=0.8,
                           label=f"offload {'on' if p['offload'] else 'off'}, "
                                 f"{'first' if first else 'later'} turns")
        ax.set_yscale("log")
        ax.set_xlabel("request sent at (s)")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"{result['preset']}, {regime} regime", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    machine = result["machine"].get("gpu") or f"CPU ({result['machine'].get('num_cpus')} cores)"
    fig.suptitle(f"TTFT over time, {Path(result['model_dir']).name} on {machine}"
                 + (" (scaled-down run)" if result["scale"] < 1 else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m benchmarks.multiturn.presets``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), required=True)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--scale", type=float, default=1.0, help="multiply every length (CPU runs)")
    p.add_argument("--users", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--qps", type=float, default=None)
    p.add_argument("--regimes", default="pressure", help="pressure, or pressure,fits")
    p.add_argument("--pressure-factor", type=float, default=None)
    p.add_argument("--h2d-gbps", type=positive_float_arg, default=None,
                   help="raw pinned H2D GB/s for each restore's load floor (default: measured "
                        f"on CUDA; {DEFAULT_H2D_GBPS} assumed on CPU)")
    p.add_argument("--hbm-hit-ms", type=positive_float_arg, default=None,
                   help="an idle engine's HBM-hit TTFT at these lengths (benchmarks.serve), for "
                        "each restore's bound; default: this run's HBM hits, if any")
    p.add_argument("--tokens-per-word", type=float, default=None)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--duration-s", type=float, default=None, help="per configuration")
    p.add_argument("--dram", type=size_arg, default=None,
                   help="daemon DRAM (e.g. 64GiB; default: twice the working set)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the user count")
    p.add_argument("--kv-offload-policy", choices=("write-through", "evict"),
                   default="write-through")
    p.add_argument("--engine-args", default="", help="more `kvengine serve` flags, one string")
    p.add_argument("--daemon-args", default="",
                   help="more `kvstore serve` flags, one string (offload on)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--no-progress", action="store_true")
    add_client_arg(p)
    add_plan_cache_arg(p)
    p.add_argument("--order", choices=("on-first", "off-first"), default="on-first",
                   help="which configuration runs first: the first meets the machine's cold "
                        "page cache (and, with --plan-cache machine, the cold cuDNN plan cache "
                        "the second then inherits)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default=None, help="name part of the files (default: DEVICE-MODEL)")
    return p


def print_report(result: dict) -> None:
    """One line per configuration, then on against off per regime."""
    f = fmt_num
    print(f"\n{'regime':<9} {'offload':<7} {'ok':>7} {'all':>8} {'first':>8} {'later':>8} "
          f"{'p50':>8} {'p90':>8} {'p99':>8} {'ITL p50':>8} {'ITL p99':>8} {'hit':>6} "
          f"{'floor':>7} {'over':>7}")
    for p in result["points"]:
        head = f"{p['regime']:<9} {'on' if p['offload'] else 'off':<7}"
        if p["error"]:
            print(f"{head} error: {p['error'].splitlines()[0][:100]}")
            continue
        s = p["figures"]
        t, itl, rs = s["ttft_ms"], s["itl_ms"], s["restores"]
        print(f"{head} {s['num_ok']:>3}/{s['num_requests']:<3} {f(t['mean_all'])} "
              f"{f(t['mean_first_turns'])} {f(t['mean_later_turns'])} {f(t['p50'])} "
              f"{f(t['p90'])} {f(t['p99'])} {f(itl['p50'], '8.2f')} {f(itl['p99'], '8.2f')} "
              f"{f(s['hits']['hit_rate'], '6.3f')} {f(rs['load_floor_ms_mean'], '7.1f')} "
              f"{f(rs['ttft_over_floor_ms_p50'], '7.1f')}")
    print("(ms; floor: mean load floor of restored later turns, over: their TTFT above it, p50)")
    for p in result["points"]:
        phases = None if p["error"] else p["figures"].get("server_phases_ms")
        for turns, means in (phases or {}).items():
            if means:
                print(f"{p['regime']} {'on' if p['offload'] else 'off'} {turns}, ms: "
                      + " ".join(f"{k} {v:.2f}" for k, v in means.items()))
    for p in result["points"]:
        rs = None if p["error"] else p["figures"]["restores"]
        if rs and rs["ttft_over_bound_p50"] is not None:
            print(f"{p['regime']} on: restored turns over the bound (1.1 x floor + HBM-hit "
                  f"{rs['hbm_hit_ttft_ms_p50']:.1f} ms): p50 {rs['ttft_over_bound_p50']:.2f}, "
                  f"p90 {rs['ttft_over_bound_p90']:.2f}, within {rs['share_within_bound']:.0%}")
    for regime, cmp in result["comparison"].items():
        fig, met = cmp["figures"], cmp["met"]
        print(f"[{regime}] " + ", ".join(
            f"{k} {fig[k]:.2f}" + ("" if k not in met or met[k] is None
                                   else (" MET" if met[k] else " NOT MET"))
            for k in fig if fig[k] is not None))
    if result.get("fits_overhead") is not None:
        print(f"[fits] offload overhead on mean TTFT {result['fits_overhead']:+.1%} "
              f"(target <= {result['targets']['fits_overhead']:.0%})")
    if result["note"]:
        print(f"NOTE: {result['note']}")
    for p in result["points"]:
        if p.get("attention_backend"):
            print(f"{p['label']}: attention {p['attention_backend']}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    regimes = [x.strip() for x in args.regimes.split(",") if x.strip()]
    if not regimes or set(regimes) - {"pressure", "fits"}:
        parser.error("--regimes: pressure, fits or both")
    if not (args.model_dir / "config.json").exists():
        parser.error(f"--model-dir {args.model_dir}: no config.json")
    block_bytes, max_positions = model_shape(args.model_dir, args.block_size)
    tokens_per_word = args.tokens_per_word or tokens_per_word_of(args.model_dir, 0) or 1.3
    try:
        workload = scaled(preset["workload"], args.scale)
        workload = replace(workload, tokens_per_word=tokens_per_word,
                           num_users=args.users or workload.num_users,
                           num_rounds=args.rounds or workload.num_rounds)
    except ValueError as exc:
        parser.error(str(exc))
    qps = args.qps or preset["qps"]
    targets = PRESET_TARGETS[args.preset]
    pressure_factor = args.pressure_factor or preset["pressure_factor"]
    if not qps > 0 or not pressure_factor > 1:
        parser.error("--qps must be > 0 and --pressure-factor > 1")
    sizing = plan_sizing(workload, block_bytes, max_positions, block_size=args.block_size,
                         pressure_factor=pressure_factor, max_model_len=args.max_model_len,
                         dram_bytes=args.dram)
    # The sweep's fits pool (1.5x the working set) outgrows an 80 GB card at these lengths: the
    # working set plus a tenth is enough for "fits in HBM".
    ws_blocks = sizing["working_set_blocks_est"]
    fits_blocks = max(int(ws_blocks * 1.1) + 16, -(-sizing["max_model_len"] // args.block_size))
    sizing["regimes"]["fits"] = {"num_kv_blocks": fits_blocks,
                                 "working_set_over_hbm": ws_blocks / fits_blocks}
    for note in sizing["notes"]:
        print(f"warning: {note}")
    kv_bytes_per_token = block_bytes / args.block_size
    h2d_gbps, h2d_source = args.h2d_gbps, "--h2d-gbps"
    if h2d_gbps is None:
        # one history's worth of KV, measured before any server holds the GPU
        h2d_gbps = raw_h2d_gbps(int(kv_bytes_per_token * workload.history_len), args.device)
        h2d_source = "measured in this run"
    if h2d_gbps is None:
        h2d_gbps, h2d_source = DEFAULT_H2D_GBPS, "assumed (H100 figure; no CUDA here)"
    print(f"raw pinned H2D: {h2d_gbps:.1f} GB/s ({h2d_source})", flush=True)
    setup = PointSetup.from_args(args)
    points = []
    for regime in regimes:
        for offload in (True, False) if args.order == "on-first" else (False, True):
            print(f"\n== {args.preset}: {regime} regime, offload {'on' if offload else 'off'} "
                  f"({sizing['regimes'][regime]['num_kv_blocks']} KV blocks)", flush=True)
            point = run_point(setup, workload, sizing, regime, offload, qps)
            if point["error"]:
                print(f"failed: {point['error']}", flush=True)
            else:
                point["figures"] = summarize_point(point, kv_bytes_per_token, h2d_gbps,
                                                   args.hbm_hit_ms)
            points.append(point)
    comparison = {}
    for regime in regimes:
        on, off = ([p for p in points if p["regime"] == regime and p["offload"] is o
                    and not p["error"]] for o in (True, False))
        if on and off:
            comparison[regime] = compare(on[0]["figures"], off[0]["figures"], targets)
    fits = comparison.get("fits", {}).get("figures", {}).get("all_speedup")
    small = args.device == "cpu" or args.scale < 1
    result = {
        "benchmark": "multiturn_presets", "preset": args.preset, "scale": args.scale,
        "note": (f"scaled-down run ({args.device}, scale {args.scale:g}, {os.cpu_count()} cores "
                 "shared by client, engine and daemon): checks the preset end to end; its "
                 "numbers say nothing about the H100 targets" if small else None),
        "model_dir": str(args.model_dir), "device": args.device, "qps": qps, "order": args.order,
        "plan_cache": args.plan_cache,
        "workload": asdict(workload), "sizing": sizing, "h2d_gbps": h2d_gbps,
        "h2d_source": h2d_source, "hbm_hit_ms": args.hbm_hit_ms,
        "targets": targets, "comparison": comparison,
        "fits_overhead": None if fits is None else 1 / fits - 1,
        "machine": machine_info(), "date": now_iso(),
        "command": command("python -m benchmarks.multiturn.presets", argv), "points": points,
    }
    print_report(result)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = args.tag or f"{args.device}-{args.model_dir.name}"
    stem = out_dir / f"multiturn-{args.preset}-{tag}-{today()}"
    result["plot"] = plot_ttft_over_time(result, Path(f"{stem}-ttft-over-time.png"))
    write_result(out_dir, f"{stem.name}.json", result, indent=1, default=str)
    print(f"wrote {stem}.json" + (f", {result['plot']}" if result["plot"] else ""))
    return 0 if any(not p["error"] for p in points) else 1


if __name__ == "__main__":
    raise SystemExit(main())
