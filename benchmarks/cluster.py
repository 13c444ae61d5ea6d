"""Cluster benchmark: remote fetch bandwidth over UCX against raw ucxx, and the Redis index lookup.

One run, two processes on this host, one redis-server started for the run:

* process A holds ``--blocks`` blocks of ``--block-bytes`` (default: one Qwen3-4B block, 2.25 MiB)
  in a TieredStore behind a ClusterNode, plus a raw ucxx listener in the same UCX runtime;
* process B (this one) runs its own ClusterNode and, interleaved, ``--reps`` times each:
  - raw: ucxx send/recv of the same number and size of messages from A's worker to B's (all
    receives posted at once, into one reused buffer), the bandwidth the wire and UCX allow;
  - fetch: ``PeerClient.fetch`` of all blocks into a pooled buffer (request, owner-side lookup
    under a lease, header, payloads, XXH3 verification on arrival);
  - fetch_into_store: ``ClusterNode.fetch_remote_prefix`` (index lookup, then the payloads
    received straight into B's DRAM write slots, verified, committed), the daemon's remote-hit
    path end to end;
* the index: ``lookup_holders`` of 1,024 hashes that A published (one script call), p50/p99;
* the UCX lanes (``ucp_ep_query``) of the raw endpoint and of the fetch endpoints, so the result
  says which transports the numbers are of (UCX's own choice; ``UCX_*`` variables in the
  environment reach both processes and are recorded).

Usage: python benchmarks/cluster.py [--blocks 64] [--block-bytes 2359296] [--reps 9]
                                    [--ucx-tls tcp,self,sm] [--machine NAME]
Writes benchmarks/results/cluster-<machine>-<date>.json. Target: fetch ≥ 80% of raw.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date, datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import write_result  # noqa: E402

QWEN3_4B_BLOCK_BYTES = 36 * 2 * 16 * 8 * 128 * 2  # layers × K/V × tokens × KV heads × dim × bf16
NODE_TIMINGS = {"heartbeat_interval_s": 0.5, "node_ttl_s": 5.0, "remote_timeout_s": 30.0}


def _chain(num_blocks: int, seed: int) -> tuple[bytes, list[bytes], list[bytes]]:
    from kvstore.keys import Namespace, chain_hashes, chain_idents

    ns = Namespace(tenant_salt="bench", name=f"cluster-{seed}").digest
    tokens = np.random.default_rng(seed).integers(0, 150_000, size=num_blocks * 16)
    hashes = chain_hashes(ns, tokens, 16)
    idents = chain_idents(ns, tokens, 16, range(num_blocks), hashes)
    return ns, hashes, idents


def _node(redis_url: str, node_id: str, dram_bytes: int):
    from kvstore.cluster.config import ClusterConfig
    from kvstore.cluster.node import ClusterNode
    from kvstore.store.tiered import StoreConfig, TieredStore

    store = TieredStore(StoreConfig(dram_bytes=dram_bytes))
    node = ClusterNode(ClusterConfig(redis_url=redis_url, node_id=node_id, **NODE_TIMINGS), store)
    node.start(5.0)
    return node, store


# -- process A ---------------------------------------------------------------------------------


def _owner_main(conn, redis_url: str, num_blocks: int, block_bytes: int, ucx_tls: str | None):
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls
    from kvstore.cluster.ucx.runtime import UcxRuntime

    node, store = _node(redis_url, "bench-a", num_blocks * block_bytes + (64 << 20))
    ns, hashes, idents = _chain(num_blocks, seed=1)
    rng = np.random.default_rng(2)
    source = rng.integers(0, 256, size=num_blocks * block_bytes, dtype=np.uint8)
    for i in range(num_blocks):
        store.put(ns, hashes[i], idents[i], source[i * block_bytes:(i + 1) * block_bytes])
    node.on_stored(ns, hashes)
    lookup_ns, lookup_hashes, _ = _chain(1024, seed=3)
    node.on_stored(lookup_ns, lookup_hashes)  # index entries only, for the lookup benchmark
    assert node.index.flush(10.0)

    runtime = UcxRuntime.acquire()
    handlers: set = set()

    async def serve_raw(ep) -> None:
        handlers.add(asyncio.current_task())
        try:
            request = np.empty(2, dtype="<u8")
            while True:
                await ep.recv(request)
                n, size = int(request[0]), int(request[1])
                if n == 0:
                    break
                await asyncio.gather(*(ep.send(source[i * size:(i + 1) * size], tag=100 + i)
                                       for i in range(n)))
        except Exception:
            pass
        finally:
            handlers.discard(asyncio.current_task())

    async def listen():
        import ucxx

        return ucxx.create_listener(serve_raw, port=0)

    listener = runtime.call(listen(), 10.0)
    conn.send({"addr": node.addr, "raw_port": listener.port})
    conn.recv()  # the driver says stop

    async def close():
        listener.close()

    runtime.call(close(), 5.0)
    runtime.release()
    node.stop()
    store.close()


# -- process B: measurements -------------------------------------------------------------------


def _raw_client(runtime, port: int, num_blocks: int, block_bytes: int):
    """(one transfer, close, the endpoint's UCX lanes)."""
    import ucxx

    from kvstore.cluster.ucx.transports import endpoint_transports

    buffer = np.empty(num_blocks * block_bytes, dtype=np.uint8)
    ep = runtime.call(ucxx.create_endpoint("127.0.0.1", port), 10.0)

    async def lanes() -> list[str] | None:
        return endpoint_transports(ep)  # on the loop, as every ucxx call

    async def once() -> float:
        start = time.perf_counter()
        await ep.send(np.array([num_blocks, block_bytes], dtype="<u8"))
        await asyncio.gather(*(ep.recv(buffer[i * block_bytes:(i + 1) * block_bytes], tag=100 + i)
                               for i in range(num_blocks)))
        return time.perf_counter() - start

    async def close():
        await ep.send(np.array([0, 0], dtype="<u8"))
        ep.abort(period=100_000_000)

    return (lambda: runtime.call(once(), 60.0)), (lambda: runtime.call(close(), 5.0)), \
        runtime.call(lanes(), 5.0)


def _gbps(num_bytes: int, seconds: list[float]) -> dict:
    rates = [num_bytes / s / 1e9 for s in seconds]
    return {"median_gb_per_s": statistics.median(rates), "all_gb_per_s": rates,
            "median_ms": statistics.median(seconds) * 1e3}


def run(args: argparse.Namespace, redis_url: str) -> dict:
    from kvstore.cluster.ucx.runtime import UcxRuntime

    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    total = args.blocks * args.block_bytes
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_owner_main, args=(child, redis_url, args.blocks,
                                                  args.block_bytes, args.ucx_tls))
    owner.start()
    try:
        if not parent.poll(120):
            raise RuntimeError("the owner process did not start")
        info = parent.recv()
        node, store = _node(redis_url, "bench-b", total + (64 << 20))
        runtime = UcxRuntime.acquire()
        try:
            ns, hashes, idents = _chain(args.blocks, seed=1)
            raw_once, raw_close, raw_lanes = _raw_client(runtime, info["raw_port"], args.blocks,
                                                         args.block_bytes)

            def fetch_once() -> float:
                start = time.perf_counter()
                with node.client.fetch(info["addr"], ns, hashes, idents,
                                       time.monotonic() + 60) as result:
                    elapsed = time.perf_counter() - start
                    assert len(result.blocks) == args.blocks, result.error
                return elapsed

            def into_store_once() -> float:
                for h in hashes:
                    store.remove(ns, h)
                start = time.perf_counter()
                num = node.fetch_remote_prefix(ns, hashes, idents, 0)
                elapsed = time.perf_counter() - start
                assert num == args.blocks, num
                return elapsed

            for warm in (raw_once, fetch_once, into_store_once):
                warm()
            raw_s, fetch_s, store_s = [], [], []
            for _ in range(args.reps):  # interleaved, so drift hits all three alike
                raw_s.append(raw_once())
                fetch_s.append(fetch_once())
                store_s.append(into_store_once())
            raw_close()
            lookup_ns, lookup_hashes, _ = _chain(1024, seed=3)
            assert len(node.index.lookup_holders(lookup_ns, lookup_hashes)) == 1024
            lookup_s = []
            for _ in range(args.lookup_iterations):
                start = time.perf_counter()
                node.index.lookup_holders(lookup_ns, lookup_hashes)
                lookup_s.append(time.perf_counter() - start)
            lookup_s.sort()
            stats = node.stats()
            fetch_lanes = node.client.lanes().get(info["addr"])
        finally:
            runtime.release()
            node.stop()
            store.close()
    finally:
        parent.send("stop")
        owner.join(30)
        if owner.is_alive():
            owner.kill()
    from kvstore.cluster.ucx.transports import data_transports

    raw, fetch, into = (_gbps(total, s) for s in (raw_s, fetch_s, store_s))
    return {
        "transports": {
            "raw_ucxx": data_transports(raw_lanes) or ["unknown"],
            "fetch": data_transports(fetch_lanes) or ["unknown"],
            "raw_ucxx_lanes": raw_lanes, "fetch_lanes": fetch_lanes,
        },
        "transfer": {
            "blocks": args.blocks, "block_bytes": args.block_bytes, "bytes": total,
            "reps": args.reps, "raw_ucxx": raw, "fetch": fetch, "fetch_into_store": into,
            "fetch_vs_raw": fetch["median_gb_per_s"] / raw["median_gb_per_s"],
            "fetch_into_store_vs_raw": into["median_gb_per_s"] / raw["median_gb_per_s"],
            "target_ratio": 0.8,
        },
        "index_lookup_1024": {
            "iterations": args.lookup_iterations,
            "p50_ms": lookup_s[len(lookup_s) // 2] * 1e3,
            "p99_ms": lookup_s[int(len(lookup_s) * 0.99)] * 1e3,
            "min_ms": lookup_s[0] * 1e3,
        },
        "node_b_stats": stats,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-bytes", type=int, default=QWEN3_4B_BLOCK_BYTES)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--lookup-iterations", type=int, default=300)
    parser.add_argument("--ucx-tls", default=None,
                        help="UCX_TLS for both processes (default: UCX's own choice)")
    parser.add_argument("--machine", default=socket.gethostname().split(".")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    result: dict = {
        "benchmark": "cluster", "machine": args.machine, "date": date.today().isoformat(),
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command, "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(), "num_cpus": os.cpu_count(),
        "load_average_1m_at_start": os.getloadavg()[0],  # a busy small host makes noise
        "ucx_tls": args.ucx_tls or os.environ.get("UCX_TLS", "default"),
        "ucx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")},
        "note": "both processes on one host; 'transports' are the lanes UCX picked (ucp_ep_query)",
    }
    try:
        import ucxx

        result["ucx_version"] = ".".join(map(str, ucxx.get_ucx_version()))
        result["ucxx_version"] = ucxx.__version__
    except ImportError:
        raise SystemExit("benchmarks/cluster.py needs ucxx (pip install -e '.[cluster]')") from None
    work = Path(tempfile.mkdtemp(prefix="kvstore-cluster-bench-"))
    port = _free_port()
    redis = subprocess.Popen(
        [shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(port), "--bind",
         "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(work)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        result.update(run(args, f"redis://127.0.0.1:{port}/0"))
    finally:
        redis.send_signal(signal.SIGKILL)
        redis.wait(5)
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({k: v for k, v in result.items() if k != "node_b_stats"}, indent=2))
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", args.machine)
    path = write_result(args.out, f"cluster-{slug}-{result['date']}.json", result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
