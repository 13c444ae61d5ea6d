"""The multi-turn sweep's verdict and pictures: the two DESIGN.md targets per QPS (offload on
against off under HBM pressure, and its overhead when the working set fits), the table of every
point, and the TTFT and hit-rate plots."""

from __future__ import annotations

from pathlib import Path

from benchmarks.multiturn.summary import fmt_num

PRESSURE_TARGET_SPEEDUP = 3.0
FITS_TARGET_OVERHEAD = 0.05


def point_label(regime: str, offload: bool) -> str:
    """How a sweep point is named in logs and plots."""
    return f"{regime} / offload {'on' if offload else 'off'}"


def _mean_ttft(points: list[dict], regime: str, offload: bool, qps: float) -> float | None:
    for p in points:
        if (p["regime"], p["offload"], p["qps"]) == (regime, offload, qps) and not p["error"]:
            return p["summary"]["ttft_ms"]["mean"]
    return None


def evaluate_targets(points: list[dict], qps_list: list[float]) -> dict:
    """Both DESIGN.md targets, per QPS and overall (None where a point is missing)."""
    pressure, fits = [], []
    for qps in qps_list:
        on, off = (_mean_ttft(points, "pressure", o, qps) for o in (True, False))
        pressure.append({"qps": qps, "mean_ttft_ms_on": on, "mean_ttft_ms_off": off,
                         "speedup": off / on if on and off else None})
        on, off = (_mean_ttft(points, "fits", o, qps) for o in (True, False))
        fits.append({"qps": qps, "mean_ttft_ms_on": on, "mean_ttft_ms_off": off,
                     "overhead": on / off - 1 if on and off else None})

    def met(rows: list[dict], key: str, ok) -> bool | None:
        values = [r[key] for r in rows]
        return None if not values or None in values else all(ok(v) for v in values)

    return {
        "pressure": {"target": f"mean TTFT offload on >= {PRESSURE_TARGET_SPEEDUP:g}x better than "
                               "off, at every QPS (working set > HBM, < DRAM)",
                     "per_qps": pressure,
                     "met": met(pressure, "speedup", lambda v: v >= PRESSURE_TARGET_SPEEDUP)},
        "fits": {"target": f"offload costs <= {FITS_TARGET_OVERHEAD:.0%} mean TTFT, at every QPS "
                           "(working set fits in HBM)",
                 "per_qps": fits,
                 "met": met(fits, "overhead", lambda v: v <= FITS_TARGET_OVERHEAD)},
    }


def _status(met: bool | None) -> str:
    return {True: "MET", False: "NOT MET", None: "n/a (points missing)"}[met]


def print_report(result: dict) -> None:
    """The table of every point and the two targets' status."""
    print(f"\n{'regime':<9} {'offload':<7} {'qps':>5} {'ok':>7} {'TTFT mean':>10} {'p50':>8} "
          f"{'p99':>8} {'ITL p50':>8} {'req/s':>6} {'hit':>6} {'hbm':>6} {'dram':>6} {'ssd':>6}"
          f"  ws/HBM")
    for p in result["points"]:
        head = f"{p['regime']:<9} {'on' if p['offload'] else 'off':<7} {p['qps']:>5g}"
        if p["error"]:
            print(f"{head} error: {p['error'].splitlines()[0][:100]}")
            continue
        s = p["summary"]
        t, hits = s["ttft_ms"], s["hits"]
        by_tier = hits["hit_rate_by_tier"]
        f = fmt_num
        print(f"{head} {s['num_ok']:>3}/{s['num_requests']:<3} {f(t['mean'], '10.1f')} "
              f"{f(t['p50'])} {f(t['p99'])} {f(s['itl_ms']['p50'], '8.2f')} "
              f"{f(s['throughput']['requests_per_s'], '6.2f')} {f(hits['hit_rate'], '6.3f')} "
              + " ".join(f(by_tier[k], "6.3f") for k in ("hbm", "dram", "ssd"))
              + f"  {f(p.get('working_set_over_hbm_measured'), '5.1f')}")
    targets = result["targets"]
    print()
    for regime in ("pressure", "fits"):
        t = targets[regime]
        key = "speedup" if regime == "pressure" else "overhead"
        per = ", ".join(f"qps {r['qps']:g}: " + (f"{r[key]:.2f}" if r[key] is not None else "-")
                        for r in t["per_qps"])
        print(f"target [{regime} regime] {t['target']}: {_status(t['met'])} ({key} {per})")
    if result.get("smoke"):
        print(f"NOTE: {result['note']}")


def plot(result: dict, stem: Path) -> list[str]:
    """TTFT-vs-QPS and hit-rate-by-round PNGs next to the JSON; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    points = [p for p in result["points"] if not p["error"]]
    configs = sorted({(p["regime"], p["offload"]) for p in points}, key=lambda c: (c[0], not c[1]))
    machine = result["machine"].get("gpu") or f"CPU ({result['machine'].get('num_cpus')} cores)"
    title = f"multi-turn, {Path(result['model_dir']).name} on {machine}"
    if result.get("smoke"):
        title += " (CPU smoke run)"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = {"fits": "tab:blue", "pressure": "tab:red"}
    for ax, key in zip(axes, ("p50", "p99")):
        for regime, offload in configs:
            rows = sorted((p["qps"], p["summary"]["ttft_ms"][key]) for p in points
                          if (p["regime"], p["offload"]) == (regime, offload))
            ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="o",
                    color=colors.get(regime, "gray"), linestyle="-" if offload else "--",
                    label=f"{regime} regime, offload {'on' if offload else 'off'}")
        ax.set_xlabel("QPS (Poisson arrivals)")
        ax.set_ylabel(f"TTFT {key} (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    paths = [str(stem) + "-ttft.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    qps_list = sorted({p["qps"] for p in points})
    if not configs or not qps_list:
        return paths
    fig, axes = plt.subplots(len(configs), len(qps_list), squeeze=False, sharey=True,
                             figsize=(3.2 * len(qps_list) + 1, 2.6 * len(configs) + 0.8))
    tier_colors = {"hbm": "tab:green", "dram": "tab:orange", "ssd": "tab:purple",
                   "remote": "tab:gray"}
    for i, (regime, offload) in enumerate(configs):
        for j, qps in enumerate(qps_list):
            ax = axes[i][j]
            match = [p for p in points if (p["regime"], p["offload"], p["qps"])
                     == (regime, offload, qps)]
            ax.set_title(f"{point_label(regime, offload)}, qps {qps:g}", fontsize=8)
            if not match:
                continue
            rounds = match[0]["summary"]["rounds"]
            bottom = [0.0] * len(rounds)
            xs = [r["round"] for r in rounds]
            for tier, color in tier_colors.items():
                ys = [r["hit_rate_by_tier"][tier] or 0.0 for r in rounds]
                ax.bar(xs, ys, bottom=bottom, color=color, label=tier)
                bottom = [b + y for b, y in zip(bottom, ys)]
            ax.set_ylim(0, 1)
            ax.set_xticks(xs)
            ax.set_xlabel("round", fontsize=8)
            if j == 0:
                ax.set_ylabel("cached / prompt tokens", fontsize=8)
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"hit rate by tier per round\n{title}", fontsize=10)
    fig.tight_layout()
    paths.append(str(stem) + "-hits.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths
