"""The router's ``/metrics`` as the benchmarks read it: its samples by name and labels, and what
moved between two scrapes (each routing stage's mean, p50 and p90 ms, requests by reason)."""

from __future__ import annotations

import re

import httpx

_SAMPLE = re.compile(r'^(kvengine:router_\w+?)(?:_total)?(\{[^}]*\})?\s+([0-9.e+-]+|NaN)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def router_metrics(url: str) -> dict[str, float]:
    """The router's samples by name and labels (``name{a="b"}`` -> value)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            out[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return out


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """Mean ms of each router timing and requests by reason, between two scrapes."""
    def diff(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    means: dict = {}
    for stage in ("route", "prompt", "kv_locate"):
        name = f"kvengine:router_{stage}_seconds"
        count = diff(name + "_count")
        means[f"{stage}_mean_ms"] = diff(name + "_sum") / count * 1e3 if count else None
        means[f"{stage}_count"] = count
        buckets = sorted((float(dict(_LABEL.findall(key))["le"]), diff(key)) for key in after
                         if key.startswith(name + "_bucket{"))
        for q in (0.5, 0.9):
            means[f"{stage}_p{round(q * 100)}_ms"] = bucket_quantile(buckets, q)
    reasons: dict[str, float] = {}
    for key in (k for k in after if k.startswith("kvengine:router_requests{") and diff(k)):
        reason = dict(_LABEL.findall(key))["reason"]
        reasons[reason] = reasons.get(reason, 0.0) + diff(key)
    return {**means, "requests_by_reason": reasons}


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile in ms of a histogram's cumulative (upper bound, count) buckets, linear
    within the bucket it falls in (Prometheus' histogram_quantile)."""
    if not buckets or not buckets[-1][1]:
        return None
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower * 1e3
            return (lower + (upper - lower) * (rank - below) / max(count - below, 1e-9)) * 1e3
        lower, below = upper, count
    return None
