"""What the router of a node run did, as the node benchmark reads it: requests by reason (its
``/metrics``), each decision (its ``kvengine.router.routes`` debug lines) and how long the
decisions' stages took."""

from __future__ import annotations

import json
import re

import httpx

from server.router.request_router import ROUTE_LOG_PREFIX

# kvengine:router_requests_total{reason="hbm_hit",engine="..."} 3.0
_ROUTED = re.compile(r'kvengine:router_requests_total\{.*reason="(\w+)".*\}\s+([0-9.e+]+)')


def router_reasons(url: str) -> dict[str, float]:
    """Requests routed by reason, from the router's /metrics."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _ROUTED.match(line)
        if match:
            out[match.group(1)] = out.get(match.group(1), 0.0) + float(match.group(2))
    return out


def decisions(lines: list[str]) -> list[dict]:
    """The router's routing decisions (its ``kvengine.router.routes`` debug lines)."""
    out = []
    for line in lines:
        try:
            out.append(json.loads(line[line.index(ROUTE_LOG_PREFIX + "{") +
                                       len(ROUTE_LOG_PREFIX):]))
        except ValueError:
            continue
    return out


def routing_stages(decisions: list[dict]) -> dict:
    """How long kv routing's stages took (ms: p50, p90, max of the prompt's tokens and chain,
    and of the daemon's locate), for new prompts (no engine and not the store holding half of
    it: first turns) and for continued ones apart."""
    groups: dict[str, dict[str, list[float]]] = {}
    for d in decisions:
        stages = d.get("stages_ms") or {}
        if not stages:
            continue
        blocks = max(1, d.get("tokens", 0) // 16)
        held = max([d.get("stored", 0)] + [c.get("hbm", 0) for c in d.get("candidates", [])])
        group = groups.setdefault("continued" if 2 * held >= blocks else "new", {})
        for stage, ms in stages.items():
            group.setdefault(stage, []).append(float(ms))
    out: dict = {}
    for name, group in groups.items():
        out[name] = {}
        for stage, values in group.items():
            values.sort()
            out[name][stage] = {"n": len(values), "p50": values[len(values) // 2],
                                "p90": values[int(0.9 * (len(values) - 1))], "max": values[-1]}
    return out
