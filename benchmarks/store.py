"""Store micro-benchmarks: socket put/get throughput, lookup latency, SSD bandwidth vs raw disk.

Everything runs in one process tree and one run, so the ratios compare like with like:

* put/get through the control socket against a real `kvstore serve` (64 KiB and one Qwen3-4B
  block, 2.25 MiB);
* lookup of 1,024 hashes through the socket: p50/p99 round trip, full hit (with lease) and miss,
  next to the in-process ``TieredStore.lookup`` of the same chain (the store's own share);
* a CPU engine's save of 1, 64 and 256 blocks through the daemon (its arena registered as shared
  memory), per block, next to an in-process copy of the same bytes;
* SSD: raw O_DIRECT write (+ fdatasync) and read of the data size, then the SSD tier writing the
  same bytes (``flush_to_ssd``) and restoring them after a restart (lookup + read promotes each
  block), then the restore end to end through the daemon (lookup + load into shared memory).

Usage: python benchmarks/store.py [--size 1GiB] [--dir DIR] [--machine NAME] [--parts save,...]
Writes benchmarks/results/store-<machine>[-<tag>]-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import re
import shlex
import shutil
import signal
import socket
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
from kvstore import Client  # noqa: E402
from kvstore.keys import Namespace, chain_hashes, chain_idents  # noqa: E402
from kvstore.layout import KVLayout, Region  # noqa: E402
from kvstore.sizes import format_bytes, parse_size  # noqa: E402
from kvstore.store.tiered import StoreConfig, TieredStore  # noqa: E402
from offload.anon_memory import AnonymousMemory  # noqa: E402

QWEN3_4B_BLOCK_BYTES = 36 * 2 * 16 * 8 * 128 * 2  # layers x K/V x tokens x kv heads x dim x bf16
LOOKUP_BLOCKS = 1024


def pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


def chain(name: str, num_blocks: int) -> tuple[bytes, list[bytes], list[bytes]]:
    ns = Namespace(name=name).digest
    tokens = np.arange(num_blocks * 16, dtype=np.int64) % 50_000
    hashes = chain_hashes(ns, tokens, 16)
    idents = chain_idents(ns, tokens, 16, range(num_blocks), hashes)
    return ns, hashes, idents


class Daemon:
    """A `kvstore serve` subprocess for the socket benchmarks."""

    def __init__(self, *args: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvs-bench-"))
        self.socket = self.dir / "kv.sock"
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--socket",
                                      str(self.socket), "--http", "off", *args], cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.banner = []
        for line in self.proc.stdout:
            self.banner.append(line.rstrip())
            if "kvstore: ready" in line:
                break
        else:
            raise RuntimeError("daemon failed:\n" + "\n".join(self.banner))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)
        shutil.rmtree(self.dir, ignore_errors=True)


# ------------------------------------------------------------------------------ socket numbers


def bench_put_get(value_bytes: int, total_bytes: int) -> dict:
    n = max(8, total_bytes // value_bytes)
    daemon = Daemon("--dram", str(n * value_bytes + (64 << 20)))
    try:
        value = np.random.default_rng(0).integers(0, 256, value_bytes, np.uint8).tobytes()
        with Client(daemon.socket) as c:
            t0 = time.perf_counter()
            for i in range(n):
                c.put(b"k%d" % i, value)
            put_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(n):
                got = c.get(b"k%d" % i)
            get_s = time.perf_counter() - t0
            assert got == value
    finally:
        daemon.stop()
    return {"value_bytes": value_bytes, "num_ops": n,
            "put_ops_per_s": n / put_s, "put_gb_per_s": n * value_bytes / put_s / 1e9,
            "get_ops_per_s": n / get_s, "get_gb_per_s": n * value_bytes / get_s / 1e9}


def bench_lookup(iterations: int) -> dict:
    block_bytes = 4096
    ns, hashes, idents = chain("bench-lookup", LOOKUP_BLOCKS)
    daemon = Daemon("--dram", "64MiB")
    memory = AnonymousMemory(LOOKUP_BLOCKS * block_bytes, "bench-lookup")
    try:
        with Client(daemon.socket) as c:
            layout = KVLayout(LOOKUP_BLOCKS, (Region(0, memory.size_bytes, 0, block_bytes,
                                                     block_bytes),), fds=(memory.fd,))
            reg = c.register(layout, "bench")
            assert c.save(reg, ns, range(LOOKUP_BLOCKS), hashes, idents).num_saved == \
                LOOKUP_BLOCKS
            miss_hashes = [bytes(16)] + hashes[1:]
            hit, miss = [], []
            for i in range(iterations + 50):
                t0 = time.perf_counter()
                reply = c.lookup(ns, hashes, idents)
                dt = time.perf_counter() - t0
                assert reply.num_hit == LOOKUP_BLOCKS
                c.release(reply.lease_id)  # not timed
                t0 = time.perf_counter()
                assert c.lookup(ns, miss_hashes, idents).num_hit == 0
                dt_miss = time.perf_counter() - t0
                if i >= 50:  # warm-up
                    hit.append(dt)
                    miss.append(dt_miss)
            c.unregister(reg)
    finally:
        memory.close()
        daemon.stop()
    # The store's own share: the same lookup in-process, no socket.
    store = TieredStore(StoreConfig(dram_bytes=64 << 20))
    try:
        for h, ident in zip(hashes, idents):
            store.put(ns, h, ident, bytes(block_bytes))
        inproc = []
        for i in range(iterations + 50):
            t0 = time.perf_counter()
            result = store.lookup(ns, hashes, idents, lease_ttl_s=30.0)
            dt = time.perf_counter() - t0
            store.release(result.lease)
            if i >= 50:
                inproc.append(dt)
    finally:
        store.close()
    ms = 1e3
    return {"num_hashes": LOOKUP_BLOCKS, "iterations": iterations,
            "hit_p50_ms": pct(hit, 50) * ms, "hit_p99_ms": pct(hit, 99) * ms,
            "miss_p50_ms": pct(miss, 50) * ms, "miss_p99_ms": pct(miss, 99) * ms,
            "store_inprocess_hit_p50_ms": pct(inproc, 50) * ms,
            "daemon_overhead_hit_p50_ms": (pct(hit, 50) - pct(inproc, 50)) * ms,
            "target_p50_ms": 0.5, "meets_target": pct(hit, 50) * ms <= 0.5}


def bench_shm_save(block_bytes: int, counts: tuple[int, ...], reps: int) -> list[dict]:
    """A CPU engine's save of ``counts`` blocks through the daemon (a shared-memory
    registration, fresh keys each time) against an in-process copy of the same bytes."""
    num_blocks = max(counts)
    daemon = Daemon("--dram", str(num_blocks * block_bytes * (reps + 6) + (64 << 20)))
    memory = AnonymousMemory(num_blocks * block_bytes, "bench-save")
    arena = np.ndarray((memory.size_bytes,), np.uint8, memory.buf)
    arena[:] = 7
    rows = []
    try:
        with Client(daemon.socket) as c:
            layout = KVLayout(num_blocks, (Region(0, memory.size_bytes, 0, block_bytes,
                                                   block_bytes),), fds=(memory.fd,))
            reg = c.register(layout, "bench-save")
            for n in counts:
                saves, raw = [], []
                out = np.empty(n * block_bytes, np.uint8)
                for rep in range(reps + 5):
                    ns, hashes, idents = chain(f"bench-save-{n}-{rep}", n)
                    t0 = time.perf_counter()
                    assert c.save(reg, ns, range(n), hashes, idents).num_saved == n
                    dt = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    out[:] = arena[:n * block_bytes]
                    dt_raw = time.perf_counter() - t0
                    if rep >= 5:  # warm-up
                        saves.append(dt)
                        raw.append(dt_raw)
                save_ms, raw_ms = pct(saves, 50) * 1e3, pct(raw, 50) * 1e3
                rows.append({"blocks": n, "block_bytes": block_bytes, "reps": reps,
                             "save_p50_ms": save_ms, "save_p90_ms": pct(saves, 90) * 1e3,
                             "save_us_per_block": save_ms * 1e3 / n,
                             "raw_copy_p50_ms": raw_ms, "ratio_of_raw": raw_ms / save_ms})
                print(f"  save {n:4d} blocks of {block_bytes} B: {save_ms:.3f} ms p50 "
                      f"({save_ms * 1e3 / n:.1f} us a block), raw copy {raw_ms:.3f} ms",
                      flush=True)
            c.unregister(reg)
    finally:
        memory.close()
        daemon.stop()
    return rows


# ----------------------------------------------------------------------------------- SSD numbers


def raw_direct_io(directory: Path, total_bytes: int, chunk_bytes: int) -> dict:
    """O_DIRECT pwrite + fdatasync, then O_DIRECT pread, of ``total_bytes`` in ``chunk_bytes``."""
    path = directory / "raw-odirect.bin"
    buf = mmap.mmap(-1, chunk_bytes)  # page aligned, as O_DIRECT needs
    buf.write(np.random.default_rng(1).integers(0, 256, chunk_bytes, np.uint8).tobytes())
    n = total_bytes // chunk_bytes
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, n * chunk_bytes)
        os.fsync(fd)
        t0 = time.perf_counter()
        for i in range(n):
            os.pwritev(fd, [buf], i * chunk_bytes)
        os.fdatasync(fd)
        write_s = time.perf_counter() - t0
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            os.preadv(fd, [buf], i * chunk_bytes)
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    return {"bytes": n * chunk_bytes, "write_gb_per_s": n * chunk_bytes / write_s / 1e9,
            "read_gb_per_s": n * chunk_bytes / read_s / 1e9}


def _drop_page_cache_hint(directory: Path) -> None:
    # Best effort, for buffered-mode tiers; O_DIRECT reads never see the page cache anyway.
    for f in directory.glob("data-*.bin"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def ssd_tier(directory: Path, total_bytes: int, block_bytes: int) -> dict:
    """The SSD tier writing ``total_bytes`` of blocks (flush) and restoring them after restart."""
    n = total_bytes // block_bytes
    ns, hashes, idents = chain("bench-ssd", n)
    data = np.random.default_rng(2).integers(0, 256, block_bytes, np.uint8).tobytes()
    ssd_bytes = n * block_bytes * 2 + (64 << 20)
    config = StoreConfig(dram_bytes=n * block_bytes + (64 << 20), ssd_dir=directory,
                         ssd_bytes=ssd_bytes, demote_high_watermark=1.0,
                         demote_low_watermark=0.99)
    store = TieredStore(config)
    try:
        for h, ident in zip(hashes, idents):
            store.put(ns, h, ident, data)
        t0 = time.perf_counter()
        written = store.flush_to_ssd()
        write_s = time.perf_counter() - t0
        io_mode = store.stats()["tiers"]["ssd"].get("io_mode")
    finally:
        store.close()
    assert written == n, f"only {written} of {n} blocks reached the SSD"
    _drop_page_cache_hint(directory)
    store = TieredStore(StoreConfig(dram_bytes=64 * block_bytes + (16 << 20), ssd_dir=directory,
                                    ssd_bytes=ssd_bytes))
    try:
        t0 = time.perf_counter()
        for start in range(0, n, 32):  # leases of 32 blocks: promoted blocks stay pinned
            result = store.lookup(ns, hashes[start:start + 32], idents[start:start + 32])
            assert result.num_hit == min(32, n - start), result.num_hit
            with result.lease as lease:
                for i in range(result.num_hit):
                    assert len(store.read(lease, i)) == block_bytes
        read_s = time.perf_counter() - t0
    finally:
        store.close()
    return {"bytes": n * block_bytes, "block_bytes": block_bytes, "io_mode": io_mode,
            "write_gb_per_s": n * block_bytes / write_s / 1e9,
            "read_gb_per_s": n * block_bytes / read_s / 1e9}


def ssd_restore_through_daemon(directory: Path, total_bytes: int, block_bytes: int) -> dict:
    """Blocks already on SSD (from ``ssd_tier``): lookup + load into engine shared memory."""
    n = total_bytes // block_bytes
    ns, hashes, idents = chain("bench-ssd", n)
    chunk = 32
    _drop_page_cache_hint(directory)
    daemon = Daemon("--dram", str(2 * chunk * block_bytes + (16 << 20)), "--ssd-dir",
                    str(directory), "--ssd-size", str(n * block_bytes * 2 + (64 << 20)))
    memory = AnonymousMemory(chunk * block_bytes, "bench-ssd")
    try:
        with Client(daemon.socket, timeout_s=120) as c:
            reg = c.register(KVLayout(chunk, (Region(0, memory.size_bytes, 0, block_bytes,
                                                     block_bytes),), fds=(memory.fd,)), "bench")
            loaded = 0
            t0 = time.perf_counter()
            for start in range(0, n, chunk):
                hit = c.lookup(ns, hashes[start:start + chunk], idents[start:start + chunk])
                loaded += c.load(reg, hit.lease_id, range(hit.num_hit))
            read_s = time.perf_counter() - t0
            c.unregister(reg)
    finally:
        memory.close()
        daemon.stop()
    assert loaded == n, f"only {loaded} of {n} blocks restored"
    return {"bytes": n * block_bytes, "read_gb_per_s": n * block_bytes / read_s / 1e9}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", help="SSD data size (default 1GiB)")
    parser.add_argument("--block-bytes", type=int, default=QWEN3_4B_BLOCK_BYTES)
    parser.add_argument("--dir", type=Path, default=None,
                        help="a directory on the disk to measure (default: a temp dir in /var/tmp)")
    parser.add_argument("--lookup-iterations", type=int, default=500)
    parser.add_argument("--parts", default="put_get,lookup,save,ssd",
                        help="which measurements: put_get, lookup, save (a CPU engine's save "
                             "through the daemon), ssd")
    parser.add_argument("--save-block-bytes", type=int, default=4096)
    parser.add_argument("--save-reps", type=int, default=100)
    parser.add_argument("--tag", default=None, help="name part of the file (default: none)")
    parser.add_argument("--machine", default=socket.gethostname().split(".")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"put_get", "lookup", "save", "ssd"}:
        parser.error("--parts: put_get, lookup, save, ssd")
    total = parse_size(args.size)
    base = args.dir or Path("/var/tmp")
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=base))
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    result: dict = {
        "benchmark": "store", "machine": args.machine, "date": date.today().isoformat(),
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command, "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(), "num_cpus": os.cpu_count(),
        "disk_dir": str(base),
        "load_average_at_start": os.getloadavg(),  # other work on the machine skews latencies
    }
    try:
        if "put_get" in parts:
            print("put/get through the socket ...", flush=True)
            result["put_get"] = [bench_put_get(64 * 1024, 256 << 20),
                                 bench_put_get(args.block_bytes, 512 << 20)]
        if "lookup" in parts:
            print("lookup of 1,024 hashes ...", flush=True)
            result["lookup_1024"] = bench_lookup(args.lookup_iterations)
        if "save" in parts:
            print("a CPU engine's saves through the daemon ...", flush=True)
            result["shm_save"] = bench_shm_save(args.save_block_bytes, (1, 64, 256),
                                                args.save_reps)
        if "ssd" not in parts:
            return _write(args, result)
        print(f"raw O_DIRECT vs SSD tier, {format_bytes(total)} ...", flush=True)
        raw = raw_direct_io(work, total, args.block_bytes)
        tier_dir = work / "ssd"
        tier = ssd_tier(tier_dir, total, args.block_bytes)
        daemon_restore = ssd_restore_through_daemon(tier_dir, total, args.block_bytes)
        result["ssd"] = {
            "raw_odirect": raw, "tier": tier, "daemon_restore": daemon_restore,
            "tier_write_vs_raw": tier["write_gb_per_s"] / raw["write_gb_per_s"],
            "tier_read_vs_raw": tier["read_gb_per_s"] / raw["read_gb_per_s"],
            "daemon_restore_vs_raw_read": daemon_restore["read_gb_per_s"] / raw["read_gb_per_s"],
            "target_ratio": 0.8,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _write(args, result)


def _write(args: argparse.Namespace, result: dict) -> int:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", args.machine)
    tag = f"-{args.tag}" if args.tag else ""
    path = write_result(args.out, f"store-{slug}{tag}-{result['date']}.json", result)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
