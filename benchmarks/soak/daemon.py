"""CPU soak of a real `kvstore serve`: churn for N minutes, sample RSS and pool use, judge drift.

Load, all at once, against one daemon with a small DRAM pool and the SSD tier on:

* block workers (engine-like, shared-memory KV buffers): lookup with a lease, then load (bytes
  verified), release, or let the lease expire; save what missed; now and then ``evicted`` and
  ``remove``. Their namespace is ``--namespace-factor`` x the DRAM pool, so DRAM evicts and
  demotes to SSD, and the SSD (half the namespace) evicts too;
* a bytes worker: put/get of keys whose value is a function of the key, every get verified;
* a doomed client: a child process that registers, takes leases and saves, and is SIGKILLed at a
  random moment (possibly mid-frame) every few seconds; the daemon must drop what it held.

Every ``--sample-s`` seconds the daemon's VmRSS (/proc/PID/status) and its stats (pool bytes,
blocks, leases, connections, registrations) are recorded. The verdict fits the RSS slope over
the samples after warm-up and compares pool use between the first and second half of them;
after the churn stops it checks that leases, registrations and connections return to baseline.

Usage: python -m benchmarks.soak.daemon [--minutes 30] [--machine NAME]
Writes benchmarks/results/soak-<machine>-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import date, datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.common import write_result  # noqa: E402
from benchmarks.process_memory import host_memory  # noqa: E402
from benchmarks.soak.verdict import verdict  # noqa: E402
from kvstore import Client, ClientError, DaemonUnavailable  # noqa: E402
from kvstore.keys import Namespace, chain_hashes, chain_idents  # noqa: E402
from kvstore.layout import KVLayout, Region  # noqa: E402
from kvstore.sizes import parse_size  # noqa: E402
from kvstore.testing.processes import stop_process  # noqa: E402
from offload.anon_memory import AnonymousMemory  # noqa: E402

CHAIN_BLOCKS = 8


def _chains(name: str, num_chains: int, seed: int) -> tuple[bytes, list[tuple[list, list]]]:
    ns = Namespace(name=name).digest
    rng = np.random.default_rng(seed)
    chains = []
    for _ in range(num_chains):
        tokens = rng.integers(0, 50_000, CHAIN_BLOCKS * 16)
        hashes = chain_hashes(ns, tokens, 16)
        idents = chain_idents(ns, tokens, 16, range(CHAIN_BLOCKS), hashes)
        chains.append((hashes, idents))
    return ns, chains


def _block_content(block_hash: bytes, block_bytes: int) -> np.ndarray:
    """A block's bytes are its hash repeated: any load can be checked without a table."""
    return np.frombuffer(block_hash * (block_bytes // len(block_hash)), dtype=np.uint8)


def _value_of(key: bytes) -> bytes:
    rng = random.Random(key)
    return rng.randbytes(rng.randint(1, 64) * 1024)


class Tally:
    """Counts shared by the workers: operations, error codes, wrong bytes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.counts)


def block_worker(sock: Path, stop: threading.Event, tally: Tally, ns: bytes, chains: list,
                 block_bytes: int, seed: int) -> None:
    rng = random.Random(seed)
    memory = AnonymousMemory(CHAIN_BLOCKS * block_bytes, f"soak-{seed}")
    kv = np.ndarray((CHAIN_BLOCKS, block_bytes), np.uint8, memory.buf)
    try:
        with Client(sock, timeout_s=30) as c:
            reg = c.register(KVLayout(CHAIN_BLOCKS, (Region(0, memory.size_bytes, 0, block_bytes,
                                                            block_bytes),), fds=(memory.fd,)),
                             f"soak-{seed}")
            while not stop.is_set():
                hashes, idents = rng.choice(chains)
                try:
                    _block_round(c, reg, rng, tally, ns, hashes, idents, kv, block_bytes)
                except ClientError as exc:
                    tally.add(f"error_{exc.code}")
            c.unregister(reg)
    except DaemonUnavailable as exc:
        tally.add("daemon_unavailable")
        print(f"soak: block worker lost the daemon: {exc}", file=sys.stderr)
    finally:
        del kv
        memory.close()


def _block_round(c: Client, reg: int, rng: random.Random, tally: Tally, ns: bytes,
                 hashes: list, idents: list, kv: np.ndarray, block_bytes: int) -> None:
    hit = c.lookup(ns, hashes, idents, lease_ttl_s=rng.choice([2.0, 2.0, 0.5]))
    tally.add("lookups")
    tally.add("hit_blocks", hit.num_hit)
    if hit.lease_id is not None:
        action = rng.random()
        if action < 0.6:
            kv[:hit.num_hit] = 0
            loaded = c.load(reg, hit.lease_id, range(hit.num_hit))
            tally.add("loaded_blocks", loaded)
            for i in range(loaded):
                if not np.array_equal(kv[i], _block_content(hashes[i], block_bytes)):
                    tally.add("wrong_bytes")
            c.release(hit.lease_id)
        elif action < 0.9:
            c.release(hit.lease_id)
        else:
            tally.add("leases_left_to_expire")
    if hit.num_hit < CHAIN_BLOCKS:
        todo = range(hit.num_hit, CHAIN_BLOCKS)
        for i in todo:
            kv[i] = _block_content(hashes[i], block_bytes)
        reply = c.save(reg, ns, todo, hashes[hit.num_hit:], idents[hit.num_hit:])
        tally.add("saved_blocks", reply.num_saved)
    roll = rng.random()
    if roll < 0.05:
        c.evicted(ns, hashes, registration_id=reg)
        tally.add("evicted_calls")
    elif roll < 0.07:
        tally.add("removed_blocks", c.remove(ns, hashes))


def bytes_worker(sock: Path, stop: threading.Event, tally: Tally, num_keys: int,
                 seed: int) -> None:
    rng = random.Random(seed)
    try:
        with Client(sock, timeout_s=30) as c:
            while not stop.is_set():
                key = b"soak-key-%d" % rng.randrange(num_keys)
                try:
                    if rng.random() < 0.5:
                        c.put(key, _value_of(key))
                        tally.add("puts")
                    else:
                        got = c.get(key)
                        tally.add("gets")
                        if got is not None:
                            tally.add("get_hits")
                            if got != _value_of(key):
                                tally.add("wrong_bytes")
                except ClientError as exc:
                    tally.add(f"error_{exc.code}")
    except DaemonUnavailable as exc:
        tally.add("daemon_unavailable")
        print(f"soak: bytes worker lost the daemon: {exc}", file=sys.stderr)


def doomed_client_loop(sock: Path, stop: threading.Event, tally: Tally, block_bytes: int,
                       every_s: float, seed: int) -> None:
    """Start a churning child, SIGKILL it after a random while, again and again."""
    rng = random.Random(seed)
    memory = AnonymousMemory(CHAIN_BLOCKS * block_bytes, "soak-doomed")
    try:
        while not stop.is_set():  # the child registers our memory by the descriptor it inherits
            child = subprocess.Popen([sys.executable, "-m", "benchmarks.soak.daemon", "--child",
                                      str(sock), str(memory.fd), str(block_bytes),
                                      str(rng.randrange(1 << 30))], cwd=REPO,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     pass_fds=(memory.fd,))
            stop.wait(rng.uniform(0.5, 1.5) * every_s)
            child.kill()
            child.wait()
            tally.add("clients_killed")
    finally:
        memory.close()


def child_main(sock: str, fd: int, block_bytes: int, seed: int) -> None:
    """The doomed client: registers the parent's buffer (descriptor ``fd``, inherited) and
    churns until it is killed."""
    rng = random.Random(seed)
    ns, chains = _chains("soak-doomed", 32, seed % 7)
    layout = KVLayout(CHAIN_BLOCKS, (Region(0, CHAIN_BLOCKS * block_bytes, 0,
                                            block_bytes, block_bytes),), fds=(fd,))
    with Client(Path(sock), timeout_s=30) as c:
        reg = c.register(layout, f"doomed-{seed}")
        while True:
            hashes, idents = rng.choice(chains)
            hit = c.lookup(ns, hashes, idents, lease_ttl_s=30.0)  # held until we die
            if hit.num_hit < CHAIN_BLOCKS:
                c.save_async(reg, ns, range(hit.num_hit, CHAIN_BLOCKS), hashes[hit.num_hit:],
                             idents[hit.num_hit:])
            if hit.lease_id is not None:
                c.load_async(reg, hit.lease_id, range(hit.num_hit))
            c.put(b"doomed-%d" % rng.randrange(64), rng.randbytes(4096))


def sample(pid: int, c: Client, t0: float, tally: Tally) -> dict:
    stats = c.stats()
    dram, ssd = stats["tiers"]["dram"], stats["tiers"].get("ssd", {})
    daemon = stats["daemon"]
    return {"t_s": round(time.monotonic() - t0, 2), "rss_bytes": host_memory(pid)["rss_bytes"],
            "dram_used_bytes": dram["used_bytes"], "dram_blocks": dram["blocks"],
            "ssd_used_bytes": ssd.get("used_bytes", 0), "ssd_blocks": ssd.get("blocks", 0),
            "leases_active": daemon["leases_active"], "connections": daemon["connections"],
            "registrations": daemon["registrations"], "ops": tally.snapshot()}


def _start_daemon(sock: Path, ssd_dir: Path, dram: int, ssd: int, lease_ttl_s: float):
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--socket", str(sock),
                             "--http", "off", "--dram", str(dram), "--ssd-dir", str(ssd_dir),
                             "--ssd-size", str(ssd), "--lease-ttl", str(lease_ttl_s)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    banner = []
    for line in proc.stdout:
        banner.append(line.rstrip())
        if "kvstore: ready" in line:
            break
    else:
        raise RuntimeError("daemon failed:\n" + "\n".join(banner))
    # Keep draining its output so a chatty daemon never blocks on a full pipe.
    threading.Thread(target=lambda: [banner.append(x.rstrip()) for x in proc.stdout],
                     daemon=True).start()
    return proc, banner


def run(args: argparse.Namespace, command: str) -> dict:
    dram, ssd, block_bytes = parse_size(args.dram), parse_size(args.ssd_size), args.block_bytes
    num_chains = max(4, int(dram * args.namespace_factor) // (CHAIN_BLOCKS * block_bytes))
    ns, chains = _chains("soak", num_chains, args.seed)
    load_at_start = os.getloadavg()  # other work on the machine shows in the latencies
    work = Path(tempfile.mkdtemp(prefix="kvs-soak-"))
    sock = work / "kv.sock"
    proc, banner = _start_daemon(sock, work / "ssd", dram, ssd, args.lease_ttl)
    stop, tally, samples = threading.Event(), Tally(), []
    threads = [threading.Thread(target=block_worker, args=(sock, stop, tally, ns, chains,
                                                           block_bytes, args.seed + i))
               for i in range(args.block_workers)]
    threads.append(threading.Thread(target=bytes_worker, args=(sock, stop, tally,
                                                               args.num_keys, args.seed)))
    if args.kill_every > 0:
        threads.append(threading.Thread(target=doomed_client_loop, args=(
            sock, stop, tally, block_bytes, args.kill_every, args.seed)))
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    try:
        with Client(sock, timeout_s=30) as c:
            samples.append(sample(proc.pid, c, t0, tally))
            for t in threads:
                t.start()
            while time.monotonic() < end and proc.poll() is None:
                time.sleep(max(0.0, min(args.sample_s, end - time.monotonic())))
                samples.append(sample(proc.pid, c, t0, tally))
                if args.progress:
                    s = samples[-1]
                    print(f"soak: {s['t_s']:7.0f} s  rss {s['rss_bytes'] / 2**20:6.1f} MiB  "
                          f"dram {s['dram_used_bytes'] / dram:5.1%}  leases "
                          f"{s['leases_active']}  conns {s['connections']}", flush=True)
            stop.set()
            for t in threads:
                t.join(120)
            # Leases left to expire run out after their TTL; then everything is back at rest.
            time.sleep(args.lease_ttl + 1.5)
            final = sample(proc.pid, c, t0, tally)
        alive = proc.poll() is None
    finally:
        stop.set()
        stop_process(proc, timeout_s=60)
        shutil.rmtree(work, ignore_errors=True)
    ops = tally.snapshot()
    return {
        "benchmark": "soak", "machine": args.machine, "date": date.today().isoformat(),
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command, "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(), "num_cpus": os.cpu_count(),
        "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg(),
        "config": {"minutes": args.minutes, "dram_bytes": dram, "ssd_bytes": ssd,
                   "block_bytes": block_bytes, "num_chains": num_chains,
                   "chain_blocks": CHAIN_BLOCKS,
                   "namespace_bytes": num_chains * CHAIN_BLOCKS * block_bytes,
                   "block_workers": args.block_workers, "num_keys": args.num_keys,
                   "kill_every_s": args.kill_every, "lease_ttl_s": args.lease_ttl,
                   "sample_s": args.sample_s},
        "daemon_banner": banner[:6], "daemon_exit_code": proc.returncode,
        "ops": ops, "final": final, "samples": samples,
        "verdict": verdict(samples, final, dram, ssd, ops, alive, args.warmup_fraction,
                           args.rss_limit, args.drift_limit),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        child_main(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--dram", default="32MiB", help="the daemon's DRAM pool")
    parser.add_argument("--ssd-size", default="48MiB",
                        help="SSD tier size (default: half the namespace)")
    parser.add_argument("--block-bytes", type=int, default=64 * 1024)
    parser.add_argument("--namespace-factor", type=float, default=3.0,
                        help="block namespace size as a multiple of --dram")
    parser.add_argument("--block-workers", type=int, default=2)
    parser.add_argument("--num-keys", type=int, default=512, help="bytes-API key space")
    parser.add_argument("--kill-every", type=float, default=4.0,
                        help="seconds between doomed-client kills (0: none)")
    parser.add_argument("--lease-ttl", type=float, default=2.0)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--warmup-fraction", type=float, default=0.2,
                        help="share of the samples left out of the verdict (pool filling up)")
    parser.add_argument("--rss-limit", type=float, default=16.0,
                        help="largest |RSS slope| judged flat, MiB per hour")
    parser.add_argument("--drift-limit", type=float, default=0.05,
                        help="largest pool-use drift judged flat, share of capacity")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--machine", default=socket.gethostname().split(".")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--progress", action="store_true", help="print every sample")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.soak.daemon " + " ".join(shlex.quote(a) for a in argv)
    result = run(args, command)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", args.machine)
    path = write_result(args.out, f"soak-{slug}-{result['date']}.json", result)
    v = result["verdict"]
    print(json.dumps({k: v[k] for k in ("flat", "checks", "rss_slope_mib_per_hour",
                                        "dram_use_drift_of_capacity",
                                        "ssd_use_drift_of_capacity")}, indent=2))
    print(f"soak: ops {result['ops']}")
    print(f"wrote {path}")
    return 0 if v["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
