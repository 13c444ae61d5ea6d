"""The ``kvstore stats`` command: read a running daemon's ``/stats`` (over the control socket or
the admin HTTP app) and print it as a table or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvstore.cli.args import EXIT_FAILURE
from kvstore.sizes import format_bytes


def add_stats_flags(stats: argparse.ArgumentParser) -> None:
    """``kvstore stats``'s options: where to read from, and how to print."""
    stats.add_argument("--http", default=None, metavar="URL",
                       help="read /stats from the admin HTTP app, e.g. http://127.0.0.1:8791 "
                            "(default: read over the control socket)")
    stats.add_argument("--socket", type=Path, default=None,
                       help="read stats over this control socket (default: the daemon's default "
                            "socket, when --http is not given)")
    stats.add_argument("--json", action="store_true", help="print the raw JSON")


def _fetch_stats(args: argparse.Namespace) -> dict:
    if args.http:
        import urllib.error
        import urllib.request

        url = args.http if "://" in args.http else f"http://{args.http}"
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/stats", timeout=10.0) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ConnectionError(f"cannot read stats from {url}: {exc}") from None
    from kvstore.wire.client import Client

    with Client(args.socket, timeout_s=10.0) as client:
        return client.stats()


def _cell(value: Any, as_bytes: bool = False) -> str:
    if value is None:
        return "-"
    if as_bytes and isinstance(value, (int, float)):
        return format_bytes(value)
    return str(value)


def format_stats_table(stats: dict) -> str:
    """The human view of ``/stats``: one row per tier, then the daemon's counters."""
    tiers = stats.get("tiers") or {}
    columns = ["tier", "capacity", "used", "blocks", "hits", "misses"]
    rows = [columns]
    for tier, fields in tiers.items():
        if not isinstance(fields, dict):
            continue
        rows.append([tier, _cell(fields.get("capacity_bytes"), True),
                     _cell(fields.get("used_bytes"), True), _cell(fields.get("blocks")),
                     _cell(fields.get("hits")), _cell(fields.get("misses"))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]
    for key, value in stats.items():
        if key not in ("tiers", "daemon") and not isinstance(value, (dict, list)):
            lines.append(f"{key}: {value}")
    counters = stats.get("counters") or {}
    if "lookup_blocks" in counters:
        lines.append(f"lookups: {counters.get('lookups', 0)} ({counters['lookup_blocks']} "
                     f"blocks asked, {counters.get('miss_blocks', 0)} missed everywhere)")
    cluster = stats.get("cluster") or {}
    if cluster:
        index = cluster.get("index") or {}
        errors = sum(v for k, v in cluster.items() if k.startswith("remote_errors_"))
        lines.append(f"cluster: node {cluster.get('node_id')} at {cluster.get('addr')}, Redis "
                     f"{index.get('state')}, {index.get('live_nodes', 0)} live node(s), "
                     f"{index.get('published_blocks', 0)} blocks published; remote: "
                     f"{cluster.get('remote_hit_blocks', 0)} blocks fetched, "
                     f"{cluster.get('remote_misses', 0)} misses, {errors} errors")
    daemon = stats.get("daemon") or {}
    if daemon:
        lines.append(f"daemon: uptime {daemon.get('uptime_s', 0):.1f} s, connections "
                     f"{daemon.get('connections')}, leases {daemon.get('leases_active')}, "
                     f"registrations {daemon.get('registrations')}")
        for name in ("requests", "errors", "events"):
            counts = daemon.get(name) or {}
            if counts:
                lines.append(f"{name}: " + ", ".join(f"{k}={v}" for k, v in sorted(
                    counts.items())))
    return "\n".join(lines)


def stats_command(args: argparse.Namespace) -> int:
    """``kvstore stats``: print a running daemon's stats as a table (or JSON); exit status."""
    try:
        stats = _fetch_stats(args)
    except ConnectionError as exc:
        print(f"kvstore: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(json.dumps(stats, indent=2, sort_keys=True) if args.json else format_stats_table(stats))
    return 0
