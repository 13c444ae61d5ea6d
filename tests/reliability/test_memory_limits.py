"""Memory limits: a DRAM pool far too small for the workload, a memlock limit too low at start,
and a --dram larger than the memory the host can give.

What holds: puts beyond the pool evict (or, for a block that can never fit or a pool full of
leased blocks, are refused with a typed error), never a crash, and the pool's accounting stays
exact. The CPU path page-locks nothing, so a tiny RLIMIT_MEMLOCK changes nothing there and the
banner says so; ``--pin yes`` (pinning required) refuses to start, in one line, where it cannot
pin. A --dram the host cannot give is refused before anything is allocated.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from daemon_helpers import REPO_ROOT, make_chain, random_bytes, start_daemon
from support.arena import ShmArena

from kvstore.store.dram.host_memory import available_bytes, check_pool_fits
from kvstore.store.tiered import StoreConfig, TieredStore
from kvstore.wire.client import ClientError

pytestmark = pytest.mark.timeout(120)

POOL_BYTES = 1 << 20
VALUE_BYTES = 64 << 10  # 16 of them fill the pool


def _serve(*args: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    """`kvstore serve` expected to refuse: its exit status and output."""
    sock = Path(tempfile.mkdtemp(prefix="kvs-")) / "kv.sock"
    return subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--socket", str(sock),
                           "--http", "off", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO_ROOT)


# -------------------------------------------------------------------------- a pool too small


def test_daemon_with_a_pool_too_small_evicts_and_refuses_cleanly(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, dram="1MiB", http=False)
    try:
        values = {b"k%03d" % i: random_bytes(VALUE_BYTES, i) for i in range(64)}  # 4x the pool
        with daemon.client() as c:
            for key, value in values.items():
                c.put(key, value)  # never refused: the oldest make room
            served = 0
            for key, value in values.items():
                got = c.get(key)
                assert got is None or got == value, f"{key!r}: other bytes"
                served += got is not None
            assert 0 < served <= POOL_BYTES // VALUE_BYTES
            assert c.get(b"k063") == values[b"k063"]  # the newest is there
            stats = c.stats()
            dram = stats["tiers"]["dram"]
            assert dram["used_bytes"] <= dram["capacity_bytes"] == POOL_BYTES
            assert dram["used_bytes"] == dram["blocks"] * VALUE_BYTES
            assert stats["counters"]["evictions"] >= len(values) - POOL_BYTES // VALUE_BYTES

            # A value larger than the whole pool can never fit: a typed refusal, nothing lost.
            with pytest.raises(ClientError) as refused:
                c.put(b"huge", b"x" * (2 * POOL_BYTES))
            assert refused.value.code == "store_error" and "never fit" in refused.value.message
            assert c.get(b"huge") is None
            assert c.stats()["tiers"]["dram"]["used_bytes"] == dram["used_bytes"]
            assert c.stats()["counters"]["put_too_large"] == 1
        assert daemon.proc.poll() is None
    finally:
        daemon.stop()


def test_pool_full_of_leased_blocks_refuses_saves_then_recovers(tmp_path: Path) -> None:
    """Every byte of the pool held by a lease: saves answer "failed" (nothing evicted under the
    lease, nothing half-written); once the lease is done the same saves succeed."""
    daemon = start_daemon(tmp_path, dram="1MiB", http=False)
    shm_arena = ShmArena(32, VALUE_BYTES)
    try:
        arena = shm_arena.blocks
        arena[:] = np.random.default_rng(1).integers(0, 256, arena.shape, dtype=np.uint8)
        layout = shm_arena.layout
        held, extra = make_chain("pool-full", 16, seed=1), make_chain("pool-extra", 8, seed=2)
        with daemon.client() as c:
            reg = c.register(layout, "engine")
            assert c.save(reg, held.namespace, range(16), held.hashes,
                          held.idents).num_saved == 16
            lease = c.lookup(held.namespace, held.hashes, held.idents, lease_ttl_s=30.0)
            assert lease.num_hit == 16
            reply = c.save(reg, extra.namespace, range(16, 24), extra.hashes, extra.idents)
            assert reply.outcomes == ["failed"] * 8
            assert c.lookup(extra.namespace, extra.hashes, extra.idents,
                            lease_ttl_s=0).num_hit == 0
            # The leased blocks are whole: they load back exactly (which ends the lease).
            arena[:16] = 0
            assert c.load(reg, lease.lease_id, range(16)) == 16
            assert np.array_equal(arena[:16], np.random.default_rng(1).integers(
                0, 256, (32, VALUE_BYTES), dtype=np.uint8)[:16])
            assert c.stats()["daemon"]["leases_active"] == 0
            assert c.save(reg, extra.namespace, range(16, 24), extra.hashes,
                          extra.idents).num_saved == 8
            dram = c.stats()["tiers"]["dram"]
            assert dram["used_bytes"] == POOL_BYTES and dram["blocks"] == 16
            assert c.remove(held.namespace, held.hashes) + c.remove(extra.namespace,
                                                                    extra.hashes) == 16
            dram = c.stats()["tiers"]["dram"]
            assert dram["used_bytes"] == 0 and dram["blocks"] == 0 and dram["pinned_blocks"] == 0
            c.unregister(reg)
        assert daemon.proc.poll() is None
    finally:
        del arena
        shm_arena.close()
        daemon.stop()


def test_store_accounting_holds_under_overflow() -> None:
    """The same pressure in-process, with leases and odd sizes: check_integrity after each
    step (free + allocated == capacity, every allocation owned by exactly one block)."""
    from kvstore.keys import Namespace, block_hash, block_ident

    ns = Namespace(name="overflow").digest
    store = TieredStore(StoreConfig(dram_bytes=POOL_BYTES))
    rng = np.random.default_rng(3)
    leases = []
    try:
        for i in range(200):
            tokens = [i] * 16
            size = int(rng.integers(1, 3 * VALUE_BYTES))
            try:
                store.put(ns, block_hash(ns, tokens), block_ident(ns, tokens), bytes(size))
            except Exception as exc:  # only a full pool of leased blocks may refuse
                assert "pinned" in str(exc) or "never fit" in str(exc), exc
            if i % 7 == 0:
                hit = store.lookup(ns, [block_hash(ns, tokens)], [block_ident(ns, tokens)],
                                   lease_ttl_s=30.0)
                if hit.lease is not None:
                    leases.append(hit.lease)
            if len(leases) > 4:
                store.release(leases.pop(0))
            store.check_integrity()
            assert store.stats()["tiers"]["dram"]["used_bytes"] <= POOL_BYTES
        for lease in leases:
            store.release(lease)
        store.check_integrity()
    finally:
        store.close()


# ---------------------------------------------------------------------------------- memlock


@pytest.fixture
def low_memlock():
    """RLIMIT_MEMLOCK (soft) at 64 KiB for the children started meanwhile."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, hard))
    try:
        yield 64 << 10
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.skipif(_has_gpu(), reason="the CPU path: nothing to page-lock")
def test_cpu_daemon_locks_nothing_and_says_so_under_a_tiny_memlock(tmp_path: Path,
                                                                  low_memlock: int) -> None:
    daemon = start_daemon(tmp_path, dram="64MiB", http=False)
    try:
        status = Path(f"/proc/{daemon.proc.pid}/status").read_text()
        limits = Path(f"/proc/{daemon.proc.pid}/limits").read_text()
        assert f"{low_memlock}" in next(x for x in limits.splitlines() if "locked" in x)
        assert next(x for x in status.splitlines() if x.startswith("VmLck:")).split()[1] == "0"
        banner = _banner(daemon)
        assert "pinned: no (" in banner and "nothing page-locked" in banner, banner
        with daemon.client() as c:
            c.put(b"k", random_bytes(1 << 20, 1))
            assert c.get(b"k") == random_bytes(1 << 20, 1)
            dram = c.stats()["tiers"]["dram"]
        assert dram["pinned"] is False and dram["pin_error"] in ("no CuPy", "no CUDA device")
    finally:
        daemon.stop()


@pytest.mark.skipif(_has_gpu(), reason="the CPU path: pinning impossible")
def _banner(daemon) -> str:
    """The startup line that describes the DRAM pool (after the line that says it is faulted
    in)."""
    return next(line for line in daemon.lines if line.startswith("kvstore: DRAM pool"))


def test_pinning_required_refuses_to_start_in_one_line(low_memlock: int) -> None:
    start = time.monotonic()
    proc = _serve("--dram", "64MiB", "--pin", "yes")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]  # after "allocating"
    assert len(lines) == 1 and "kvstore: error: cannot set up the store (--pin yes): " \
        "cannot page-lock the 64.0 MiB host pool" in lines[0], lines
    assert "kvstore: ready" not in proc.stdout + proc.stderr
    assert time.monotonic() - start < 20


@pytest.mark.gpu
def test_gpu_pool_is_pinned_whatever_the_memlock_limit(tmp_path: Path, low_memlock: int) -> None:
    """CUDA page-locks without RLIMIT_MEMLOCK: --pin yes starts and pins under a 64 KiB limit
    (nothing counts as mlocked), so the daemon must not refuse on that limit."""
    daemon = start_daemon(tmp_path, "--pin", "yes", dram="256MiB", http=False)
    try:
        assert "pinned: yes" in _banner(daemon), daemon.lines
        with daemon.client() as c:
            c.put(b"k", random_bytes(1 << 20, 2))
            assert c.get(b"k") == random_bytes(1 << 20, 2)
            dram = c.stats()["tiers"]["dram"]
        assert dram["pinned"] is True and dram["pin_error"] is None
    finally:
        daemon.stop()


def test_pin_no_never_pins_and_says_why(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, "--pin", "no", dram="8MiB", http=False)
    try:
        assert "pinned: no (--pin no)" in _banner(daemon), daemon.lines
        with daemon.client() as c:
            dram = c.stats()["tiers"]["dram"]
        assert dram["pinned"] is False and dram["pin_error"] is None
    finally:
        daemon.stop()


# ----------------------------------------------------------------------- too little memory


def test_dram_larger_than_available_memory_is_refused_up_front() -> None:
    available = available_bytes()
    assert available is not None  # Linux: /proc/meminfo is there
    too_much = available[0] * 2 + (1 << 30)
    start = time.monotonic()
    proc = _serve("--dram", str(too_much))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "is more memory than this host can give" in lines[0]
    assert "available (MemAvailable in /proc/meminfo" in lines[0] or "cgroup" in lines[0]
    assert "choose a smaller --dram" in lines[0]
    assert time.monotonic() - start < 20  # refused before allocating anything


def test_available_memory_takes_the_tighter_of_host_and_cgroup(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    no_cgroup = tmp_path / "none"
    assert available_bytes(meminfo, no_cgroup) == (8_000_000 * 1024,
                                                   f"MemAvailable in {meminfo}")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("3000000000\n")
    (v2 / "memory.current").write_text("1000000000\n")
    assert available_bytes(meminfo, v2)[0] == 2_000_000_000
    (v2 / "memory.max").write_text("max\n")  # no limit: the host's number
    assert available_bytes(meminfo, v2)[0] == 8_000_000 * 1024
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited
    assert available_bytes(meminfo, v1)[0] == 8_000_000 * 1024
    (v1 / "memory" / "memory.limit_in_bytes").write_text("1500000000\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("500000000\n")
    assert available_bytes(meminfo, v1)[0] == 1_000_000_000
    with pytest.raises(ValueError, match="1.00 GiB is more memory .* 954 MiB available"):
        check_pool_fits(1 << 30, meminfo, v1)
    check_pool_fits(900 << 20, meminfo, v1)
