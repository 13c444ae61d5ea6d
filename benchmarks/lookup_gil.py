"""Lookup round trips from an engine-like process whose step thread is busy in Python, by the
process's GIL switch interval.

An engine sends its store requests from a link thread and reads the replies on the client's
reader thread, while its step thread spends long stretches in Python (scheduling, kernel
launches). Each of those threads waits for the GIL up to the interpreter's switch interval
(5 ms by default) when the step thread holds it, so a lookup the daemon answers in about a
millisecond can come back many milliseconds later: after the step that wanted it began. This
starts a real ``kvstore serve``, keeps one thread of this process busy in pure Python, and times
``lookup`` round trips of ``--blocks`` blocks from another thread, alternating the switch
intervals given (``kvengine serve`` sets ``server.cli.SERVE_SWITCH_INTERVAL_S``).

    python -m benchmarks.lookup_gil [--intervals-ms 5,0.5] [--rounds 2] [--seconds 4]
                                    [--blocks 1200] [--out DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import command, machine_info, now_iso, today, write_result
from kvstore.keys import Namespace, block_hashes, block_ident
from kvstore.wire.client import Client


def _chain(num_blocks: int, block_size: int = 16) -> tuple[bytes, list[bytes], list[bytes]]:
    namespace = Namespace(name="lookup-gil").digest
    tokens = np.random.default_rng(0).integers(0, 50_000, num_blocks * block_size)
    hashes = block_hashes(namespace, tokens, block_size)
    parents = [namespace, *hashes[:-1]]
    idents = [block_ident(parents[i], tokens[i * block_size:(i + 1) * block_size])
              for i in range(num_blocks)]
    return namespace, hashes, idents


def _round_trips_ms(socket_path: Path, chain, seconds: float, interval_s: float,
                    busy_thread: bool = True) -> np.ndarray:
    """Lookup round trips (ms) while another thread of this process runs pure Python (or,
    without ``busy_thread``, while nothing else runs: the floor)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    stop = threading.Event()

    def busy() -> None:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i * i

    worker = threading.Thread(target=busy if busy_thread else stop.wait, daemon=True)
    worker.start()
    out = []
    try:
        with Client(socket_path) as client:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                t0 = time.perf_counter()
                client.lookup_async(*chain).wait()
                out.append((time.perf_counter() - t0) * 1e3)
                time.sleep(0.005)
    finally:
        stop.set()
        worker.join()
        sys.setswitchinterval(before)
    return np.array(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals-ms", default="5,0.5")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--blocks", type=int, default=1200)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    intervals = [float(x) for x in args.intervals_ms.split(",")]
    socket_path = Path(tempfile.mkdtemp(prefix="kvs-gil-")) / "kvstore.sock"
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--socket",
                             str(socket_path), "--dram", "256MiB", "--http", "off",
                             "--ssd-size", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "kvstore: ready" in line:
            break
    else:
        raise RuntimeError(f"kvstore serve exited with {proc.wait()}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    chain = _chain(args.blocks)
    rows = []
    try:
        for rnd in range(args.rounds):
            for ms, busy in [(intervals[0], False)] + [(ms, True) for ms in intervals]:
                lat = _round_trips_ms(socket_path, chain, args.seconds, ms / 1e3, busy)
                row = {"round": rnd, "switch_interval_ms": ms, "busy_thread": busy,
                       "n": len(lat),
                       "p50_ms": float(np.median(lat)), "p90_ms": float(np.percentile(lat, 90)),
                       "p99_ms": float(np.percentile(lat, 99))}
                rows.append(row)
                beside = "a busy Python thread beside" if busy else "nothing else running"
                print(f"switch interval {ms:g} ms, {beside}: lookup of "
                      f"{args.blocks} blocks p50 {row['p50_ms']:.2f} p90 {row['p90_ms']:.2f} "
                      f"p99 {row['p99_ms']:.2f} ms ({row['n']} round trips)", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    result = {"benchmark": "lookup_gil", "date": now_iso(), "machine": machine_info(),
              "blocks": args.blocks, "rows": rows,
              "command": command("python -m benchmarks.lookup_gil", argv)}
    path = write_result(args.out, f"lookup_gil-{today()}.json", result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
