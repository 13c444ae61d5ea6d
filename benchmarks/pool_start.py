"""The DRAM pool's start: map, fault in and page-lock ``--gib`` GiB, by thread count; then a real
``kvstore serve --dram`` of the same size, start to ready. GPU hosts only (pinning needs CUDA).

Rows: ``workers`` threads (``HostPool(workers=...)``, chunks the pool split among them), with
the pool faulted in first (``populate``) or left to ``cudaHostRegister`` to fault; seconds to
a usable pool and to close it. The daemon's row is wall clock from its start to "kvstore:
ready" (SSD off, admin HTTP off).

    python -m benchmarks.pool_start [--gib 64] [--workers 1,16,32] [--out DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

from benchmarks.common import command, machine_info, now_iso, today, write_result

GiB = 1 << 30


def pool_row(size: int, workers: int, populate: bool) -> dict:
    from kvstore.store.dram.pool import HostPool

    started = time.perf_counter()
    pool = HostPool(size, pin=True, workers=workers, populate=populate)
    ready = time.perf_counter()
    chunks = len(pool.spans())
    pool.close()
    return {"workers": workers, "populate": populate, "chunk_gib": pool.chunk_bytes / GiB,
            "chunks": chunks, "start_s": round(ready - started, 2),
            "close_s": round(time.perf_counter() - ready, 2)}


def daemon_ready_s(gib: int) -> float:
    socket_path = tempfile.mkdtemp() + "/kvstore.sock"
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--socket",
                             socket_path, "--dram", f"{gib}GiB", "--http", "off",
                             "--ssd-size", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "kvstore: ready" in line:
                return time.perf_counter() - started
        raise RuntimeError(f"kvstore serve exited with {proc.wait()} before it was ready")
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=64)
    parser.add_argument("--workers", default="1,16,32")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    size = args.gib * GiB
    rows = []
    for workers in (int(w) for w in args.workers.split(",")):
        for populate in (True, False):
            rows.append(pool_row(size, workers, populate))
            print(rows[-1], flush=True)
    ready_s = daemon_ready_s(args.gib)
    print(f"kvstore serve --dram {args.gib}GiB: ready in {ready_s:.2f} s")
    out = {"benchmark": "pool_start", "gib": args.gib, "rows": rows,
           "daemon_ready_s": round(ready_s, 2), "machine": machine_info(), "date": now_iso(),
           "command": command("python -m benchmarks.pool_start", argv)}
    print(f"wrote {write_result(args.out, f'pool-start-{args.gib}gib-{today()}.json', out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
