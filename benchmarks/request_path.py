"""A daemon request's own cost, on CPU: small saves, lookups and loads of a CPU engine.

A shared-memory engine (``--blocks`` blocks of ``--block-kib`` KiB, small enough that the copies
take a few microseconds) runs rounds of a save of all its blocks under fresh keys, a lookup of
them and a load of the hit into the other half of its blocks, through a real ``kvstore serve``;
what each request costs beyond its copies is the daemon's and the client's way around them
(socket, decode, the hop to a worker, the reply). Reported: each verb's p50/p90 ms at the client
and, with ``--request-trace``, each verb's stages in the daemon (``request_trace``: p10/p50/p90
µs). ``--daemon-tree DIR`` runs the daemon of another checkout (an older commit, say) against
this client, for a before/after in one run; run both in turn on the same machine.

    python -m benchmarks.request_path [--rounds 300] [--blocks 16] [--block-kib 64]
                                      [--request-trace] [--daemon-tree DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_daemon import start_daemon, stop_daemon
from benchmarks.common import finish, percentile
from benchmarks.store import chain
from kvstore import Client
from kvstore.layout import KVLayout, Region
from offload.anon_memory import AnonymousMemory


def _commit(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=16, help="saved and loaded a round")
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--request-trace", action="store_true")
    parser.add_argument("--daemon-tree", type=Path, default=None)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    n, block_bytes = args.blocks, args.block_kib << 10
    tree = args.daemon_tree.resolve() if args.daemon_tree else Path(__file__).parents[1]
    stages = Path(tempfile.mkdtemp(prefix="request-path-")) / "stages.jsonl"
    memory = AnonymousMemory(2 * n * block_bytes, "request-path")
    np.ndarray((memory.size_bytes,), np.uint8, memory.buf)[:] = 7
    layout = KVLayout(2 * n, (Region(0, memory.size_bytes, 0, block_bytes, block_bytes),),
                      fds=(memory.fd,))
    proc, socket_path = start_daemon(
        (args.rounds + 16) * n * block_bytes + (64 << 20),
        request_trace=stages if args.request_trace else None,
        tree=args.daemon_tree.resolve() if args.daemon_tree else None)
    ms: dict[str, list[float]] = {"save": [], "lookup": [], "load": []}
    try:
        with Client(socket_path, timeout_s=30.0) as client:
            reg = client.register(layout, "request-path")
            started = time.monotonic()
            for i in range(args.rounds + 10):  # ten rounds of warm-up
                namespace, hashes, idents = chain(f"request-path-{i}", n)
                t0 = time.perf_counter()
                saved = client.save(reg, namespace, list(range(n)), hashes, idents)
                t1 = time.perf_counter()
                hit = client.lookup(namespace, hashes, idents)
                t2 = time.perf_counter()
                loaded = client.load(reg, hit.lease_id, list(range(n, 2 * n)))
                t3 = time.perf_counter()
                if saved.num_saved != n or loaded != n:
                    raise RuntimeError(f"round {i}: saved {saved.num_saved}, loaded {loaded}")
                if i == 9:
                    started = time.monotonic()
                if i >= 10:
                    for verb, a, b in (("save", t0, t1), ("lookup", t1, t2), ("load", t2, t3)):
                        ms[verb].append((b - a) * 1e3)
            ended = time.monotonic()
            events = client.stats()["daemon"]["events"]
    finally:
        stop_daemon(proc, socket_path)
        memory.close()
    out: dict = {"rounds": args.rounds, "blocks": n, "block_bytes": block_bytes,
                 "daemon_tree": str(tree), "daemon_commit": _commit(tree),
                 "replies_by_worker": events.get("replies_by_worker")}
    for verb, values in ms.items():
        out[f"{verb}_p50_ms"] = percentile(values, 0.5)
        out[f"{verb}_p90_ms"] = percentile(values, 0.9)
        print(f"{verb:>7}: p50 {out[f'{verb}_p50_ms']:.3f} ms, p90 "
              f"{out[f'{verb}_p90_ms']:.3f} ms", flush=True)
    out["round_p50_ms"] = sum(out[f"{verb}_p50_ms"] for verb in ms)
    print(f"a round (save + lookup + load) at p50: {out['round_p50_ms']:.3f} ms, daemon "
          f"{out['daemon_commit']}, replies written by workers: {out['replies_by_worker']}")
    if args.request_trace:
        from benchmarks.request_trace import summarize

        out["stages_us_p10_p50_p90"] = summarize(stages, ("save", "lookup", "load"),
                                                 window=(started, ended), spread=True)
        for what, gaps in out["stages_us_p10_p50_p90"].items():
            print(f"  stages {what}: " + " ".join(
                f"{k}={'/'.join(f'{x:g}' for x in v)}" for k, v in gaps.items()
                if k != "requests"), flush=True)
    finish("request_path", out, args.out, argv, machine={
        "node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
