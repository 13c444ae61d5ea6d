"""Lookup round trips beside a busy Python thread, by the GIL switch interval of the busy process.

``--busy engine``: an engine sends its store requests from a link thread and reads the replies on
the client's reader thread, while its step thread spends long stretches in Python (scheduling,
kernel launches). Each of those threads waits for the GIL up to the interpreter's switch
interval (5 ms by default) when the step thread holds it, so a lookup the daemon answers in
about a millisecond can come back many milliseconds later: after the step that wanted it began.
This keeps one thread of this process busy in pure Python and times ``lookup`` round trips of
``--blocks`` blocks from another thread, alternating the switch intervals given (``kvengine
serve`` sets ``server.cli.SERVE_SWITCH_INTERVAL_S``).

``--busy daemon``: the same wait inside the daemon, whose event loop reads requests and writes
replies while worker threads run a save's bookkeeping in Python. A child process saves
``--save-blocks`` blocks at a time (fresh hashes, shared-memory engine memory) as fast as the
daemon takes them, and this quiet process times lookups; a fresh ``kvstore serve`` per switch
interval (``kvstore.cli.command.main``'s ``switch_interval_s``). Also the child's saves per
second: a shorter interval must not slow the work that keeps the daemon busy.

``--busy own-save``: what an engine with write-through does at every step: a save of the
blocks just computed, and a new request's lookup sent right behind it on the same connection,
which the scheduler then waits for. Lookups timed alone and right behind such a save (sent
without waiting for it), on one connection, under each switch interval.

    python -m benchmarks.lookup_gil [--busy engine,daemon,own-save] [--intervals-ms 5,0.5]
        [--rounds 2] [--seconds 4] [--blocks 1200] [--save-blocks 256] [--out DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import finish, today
from benchmarks.vllm_store.store_process import REPO_ROOT, start_store, stop_store
from kvstore.keys import Namespace, chain_hashes, chain_idents
from kvstore.layout import KVLayout, Region
from kvstore.wire.client import Client
from offload.anon_memory import AnonymousMemory

SAVE_BLOCK_BYTES = 16 << 10  # small blocks: the daemon's per-block Python is what keeps it busy


def _chain(num_blocks: int, name: str = "lookup-gil", seed: int = 0,
           block_size: int = 16) -> tuple[bytes, list[bytes], list[bytes]]:
    namespace = Namespace(name=name).digest
    tokens = np.random.default_rng(seed).integers(0, 50_000, num_blocks * block_size)
    hashes = chain_hashes(namespace, tokens, block_size)
    idents = chain_idents(namespace, tokens, block_size, range(num_blocks), hashes)
    return namespace, hashes, idents


def _start_daemon(switch_interval_s: float | None) -> tuple[subprocess.Popen, Path]:
    """A ``kvstore serve`` on a fresh socket (serving under the switch interval given, else
    its own)."""
    return start_store("256MiB", switch_interval_s=switch_interval_s)


def _round_trips_ms(socket_path: Path, chain, seconds: float) -> np.ndarray:
    out = []
    with Client(socket_path) as client:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            client.lookup_async(*chain).wait()
            out.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.005)
    return np.array(out)


def _beside_busy_thread_ms(socket_path: Path, chain, seconds: float, interval_s: float,
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
    try:
        return _round_trips_ms(socket_path, chain, seconds)
    finally:
        stop.set()
        worker.join()
        sys.setswitchinterval(before)


def _register(client: Client, memory: AnonymousMemory, num_blocks: int, name: str) -> int:
    """``memory`` registered as ``num_blocks`` blocks of SAVE_BLOCK_BYTES; the registration."""
    region = Region(0, memory.size_bytes, 0, SAVE_BLOCK_BYTES, SAVE_BLOCK_BYTES)
    return client.register(KVLayout(num_blocks, (region,), dtype="uint8", fds=(memory.fd,)),
                           name)


def saver_main(socket_path: str, num_blocks: int, seconds: float) -> None:
    """The child of ``--busy daemon``: save ``num_blocks`` fresh blocks at a time for
    ``seconds``, then print ``SAVES <count> <elapsed_s>``."""
    memory = AnonymousMemory(num_blocks * SAVE_BLOCK_BYTES, "lookup-gil-saver")
    try:
        with Client(socket_path) as client:
            registration = _register(client, memory, num_blocks, "lookup-gil-saver")
            count, start = 0, time.monotonic()
            while time.monotonic() - start < seconds:
                namespace, hashes, idents = _chain(num_blocks, "lookup-gil-saver", count + 1)
                client.save(registration, namespace, list(range(num_blocks)), hashes, idents)
                count += 1
            print(f"SAVES {count} {time.monotonic() - start:.3f}", flush=True)
    finally:
        memory.close()


def _beside_busy_daemon(args, interval_s: float) -> tuple[np.ndarray, float]:
    """Lookup round trips (ms) from this quiet process while a child keeps the daemon saving;
    and the child's saves per second."""
    proc, socket_path = _start_daemon(interval_s)
    try:
        chain = _chain(args.blocks)
        saver = subprocess.Popen([sys.executable, "-m", "benchmarks.lookup_gil", "--saver",
                                  str(socket_path), "--save-blocks", str(args.save_blocks),
                                  "--seconds", str(args.seconds + 1.0)],
                                 stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
        try:
            time.sleep(0.5)  # the saver registers and gets going
            lat = _round_trips_ms(socket_path, chain, args.seconds)
            out, _ = saver.communicate(timeout=60)
        finally:
            if saver.poll() is None:
                saver.kill()
                saver.wait(10)
        if saver.returncode != 0 or not out.startswith("SAVES "):
            raise RuntimeError(f"the saver failed ({saver.returncode}): {out!r}")
        count, elapsed = out.split()[1:3]
        return lat, int(count) / float(elapsed)
    finally:
        stop_store(proc, socket_path)


def _behind_own_save(args, interval_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Lookup round trips (ms) on one connection: alone, and sent right behind a save of
    ``--save-blocks`` fresh blocks (the save not waited for first)."""
    proc, socket_path = _start_daemon(interval_s)
    memory = AnonymousMemory(args.save_blocks * SAVE_BLOCK_BYTES, "lookup-gil-own-save")
    try:
        with Client(socket_path) as client:
            registration = _register(client, memory, args.save_blocks, "lookup-gil-own-save")
            chain = _chain(args.blocks)
            out: dict[bool, list[float]] = {False: [], True: []}
            count, end = 0, time.monotonic() + args.seconds
            while time.monotonic() < end:
                for behind in (False, True):
                    count += 1
                    save = None
                    if behind:
                        namespace, hashes, idents = _chain(args.save_blocks, "own-save", count)
                        save = client.save_async(registration, namespace,
                                                 list(range(args.save_blocks)), hashes, idents)
                    t0 = time.perf_counter()
                    client.lookup_async(*chain).wait()
                    out[behind].append((time.perf_counter() - t0) * 1e3)
                    if save is not None:
                        save.wait()
                    time.sleep(0.005)
        return np.array(out[False]), np.array(out[True])
    finally:
        memory.close()
        stop_store(proc, socket_path)


def _row(rnd: int, busy: str, ms: float, lat: np.ndarray, **extra) -> dict:
    return {"round": rnd, "busy": busy, "switch_interval_ms": ms, "n": len(lat),
            "mean_ms": float(lat.mean()), "p50_ms": float(np.median(lat)),
            "p90_ms": float(np.percentile(lat, 90)), "p99_ms": float(np.percentile(lat, 99)),
            **extra}


def _say(row: dict, what: str, blocks: int) -> None:
    extra = f", {row['saves_per_s']:.0f} saves/s" if "saves_per_s" in row else ""
    print(f"switch interval {row['switch_interval_ms']:g} ms, {what}: lookup of {blocks} "
          f"blocks mean {row['mean_ms']:.2f} p50 {row['p50_ms']:.2f} p90 {row['p90_ms']:.2f} "
          f"p99 {row['p99_ms']:.2f} ms ({row['n']} round trips{extra})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", default="engine,daemon")
    parser.add_argument("--intervals-ms", default="5,0.5")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--blocks", type=int, default=1200)
    parser.add_argument("--save-blocks", type=int, default=256)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--saver", metavar="SOCKET", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.saver:
        saver_main(args.saver, args.save_blocks, args.seconds)
        return 0
    intervals = [float(x) for x in args.intervals_ms.split(",")]
    busy_kinds = args.busy.split(",")
    if not set(busy_kinds) <= {"engine", "daemon", "own-save"}:
        parser.error("--busy takes engine, daemon, own-save, or several of them")
    rows = []
    if "engine" in busy_kinds:
        proc, socket_path = _start_daemon(None)
        chain = _chain(args.blocks)
        try:
            for rnd in range(args.rounds):
                for ms, busy in [(intervals[0], False)] + [(ms, True) for ms in intervals]:
                    lat = _beside_busy_thread_ms(socket_path, chain, args.seconds, ms / 1e3, busy)
                    rows.append(_row(rnd, "engine_thread" if busy else "none", ms, lat))
                    _say(rows[-1], "a busy Python thread beside" if busy
                         else "nothing else running", args.blocks)
        finally:
            stop_store(proc, socket_path)
    if "daemon" in busy_kinds:
        for rnd in range(args.rounds):
            for ms in intervals:
                lat, saves_per_s = _beside_busy_daemon(args, ms / 1e3)
                rows.append(_row(rnd, "daemon_saves", ms, lat, saves_per_s=saves_per_s))
                _say(rows[-1], f"the daemon saving {args.save_blocks} blocks at a time",
                     args.blocks)
    if "own-save" in busy_kinds:
        for rnd in range(args.rounds):
            for ms in intervals:
                alone, behind = _behind_own_save(args, ms / 1e3)
                rows.append(_row(rnd, "none_same_connection", ms, alone))
                _say(rows[-1], "alone on the connection", args.blocks)
                rows.append(_row(rnd, "own_save", ms, behind))
                _say(rows[-1], f"right behind its own save of {args.save_blocks} blocks",
                     args.blocks)
    finish("lookup_gil", {"blocks": args.blocks, "save_blocks": args.save_blocks,
                          "save_block_bytes": SAVE_BLOCK_BYTES, "rows": rows}, args.out, argv,
           name=f"lookup_gil-{'-'.join(busy_kinds)}-{today()}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
