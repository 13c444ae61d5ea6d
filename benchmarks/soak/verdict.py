"""The soak's verdict: from periodic samples of the daemon (RSS, DRAM and SSD use, leases), whether
memory and usage stayed flat (drift between the halves of the steady part, slope per hour) and
whether any byte came back wrong."""

from __future__ import annotations

import numpy as np


def _slope_per_hour(ts: list[float], ys: list[float]) -> float:
    if len(ts) < 2 or max(ts) == min(ts):
        return 0.0
    return float(np.polyfit(np.asarray(ts) / 3600.0, np.asarray(ys), 1)[0])


def verdict(samples: list[dict], final: dict, dram_bytes: int, ssd_bytes: int, tally: dict,
            alive: bool, warmup_fraction: float, rss_limit_mib_per_h: float,
            drift_limit: float) -> dict:
    """Flat means: RSS slope and pool-use drift under their limits, baseline restored, no
    wrong bytes, the daemon alive."""
    steady = samples[int(len(samples) * warmup_fraction):]
    ts = [s["t_s"] for s in steady]
    rss_mib = [s["rss_bytes"] / 2**20 for s in steady]
    half = len(steady) // 2

    def drift(field: str, capacity: int) -> float:
        if half == 0 or capacity == 0:
            return 0.0
        first = np.mean([s[field] for s in steady[:half]])
        second = np.mean([s[field] for s in steady[half:]])
        return float((second - first) / capacity)

    rss_slope = _slope_per_hour(ts, rss_mib)
    dram_drift = drift("dram_used_bytes", dram_bytes)
    ssd_drift = drift("ssd_used_bytes", ssd_bytes)
    baseline = (final["leases_active"] == 0 and final["registrations"] == 0
                and final["connections"] == 1)
    checks = {
        "daemon_alive": alive,
        "no_wrong_bytes": tally.get("wrong_bytes", 0) == 0,
        "no_lost_daemon": tally.get("daemon_unavailable", 0) == 0,
        "rss_flat": abs(rss_slope) <= rss_limit_mib_per_h,
        "dram_use_flat": abs(dram_drift) <= drift_limit,
        "ssd_use_flat": abs(ssd_drift) <= drift_limit,
        "baseline_after_churn": baseline,
    }
    return {"flat": all(checks.values()), "checks": checks,
            "num_steady_samples": len(steady),
            "rss_slope_mib_per_hour": rss_slope, "rss_limit_mib_per_hour": rss_limit_mib_per_h,
            "rss_steady_first_mib": rss_mib[0] if rss_mib else None,
            "rss_steady_last_mib": rss_mib[-1] if rss_mib else None,
            "rss_steady_max_mib": max(rss_mib) if rss_mib else None,
            "dram_use_drift_of_capacity": dram_drift, "ssd_use_drift_of_capacity": ssd_drift,
            "drift_limit_of_capacity": drift_limit,
            "dram_use_mean_of_capacity": float(np.mean([s["dram_used_bytes"] for s in steady])
                                               / dram_bytes) if steady else None}
