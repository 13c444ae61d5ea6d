"""The block verbs through a real daemon: register shared memory, save, lookup, load."""

from __future__ import annotations

import numpy as np
import pytest
from daemon_helpers import RunningDaemon, make_chain, wait_until
from support.arena import ShmArena

from kvstore.layout import KVLayout, Region
from kvstore.wire.client import Client, ClientError

pytestmark = pytest.mark.timeout(90)

NUM_BLOCKS = 8
BLOCK_BYTES = 64 * 1024


def _engine_arena(num_blocks: int, block_bytes: int, fill_seed: int | None,
                  split_kv: bool = False) -> ShmArena:
    """An engine's KV arena; split K and V regions start after 4 KiB of slack (offsets count)."""
    return ShmArena(num_blocks, block_bytes, fill_seed, split_kv=split_kv,
                    lead_bytes=4096 if split_kv else 0)


def _stats_daemon(c: Client) -> dict:
    return c.stats()["daemon"]


@pytest.mark.parametrize("split_kv", [False, True])
def test_save_lookup_load_round_trip(daemon: RunningDaemon, arenas: list[ShmArena],
                                     split_kv: bool) -> None:
    src = _engine_arena(NUM_BLOCKS, BLOCK_BYTES, fill_seed=11, split_kv=split_kv)
    dst = _engine_arena(NUM_BLOCKS, BLOCK_BYTES, fill_seed=None, split_kv=split_kv)
    arenas += [src, dst]
    chain = make_chain(f"round-trip-{split_kv}", NUM_BLOCKS, seed=int(split_kv))
    src_ids = [3, 1, 4, 0, 5, 2, 6, 7]  # engine blocks need not be in chain order
    with daemon.client() as engine_a, daemon.client() as engine_b:
        reg_a = engine_a.register(src.layout, "engine-a")
        saved = engine_a.save(reg_a, chain.namespace, src_ids, chain.hashes, chain.idents)
        assert saved.outcomes == ["saved"] * NUM_BLOCKS
        again = engine_a.save(reg_a, chain.namespace, src_ids, chain.hashes, chain.idents)
        assert again.outcomes == ["duplicate"] * NUM_BLOCKS
        assert engine_a.evicted(chain.namespace, chain.hashes, reg_a) == NUM_BLOCKS
        assert engine_a.unregister(reg_a)

        reg_b = engine_b.register(dst.layout, "engine-b")
        leases_before = _stats_daemon(engine_b)["leases_active"]
        hit = engine_b.lookup(chain.namespace, chain.hashes, chain.idents)
        assert hit.num_hit == NUM_BLOCKS and hit.tiers == ["dram"] * NUM_BLOCKS
        assert hit.lease_id is not None
        assert _stats_daemon(engine_b)["leases_active"] == leases_before + 1
        dst_ids = [7, 6, 5, 4, 3, 2, 1, 0]
        assert engine_b.load(reg_b, hit.lease_id, dst_ids) == NUM_BLOCKS
        for i in range(NUM_BLOCKS):
            assert dst.block(dst_ids[i]) == src.block(src_ids[i]), f"block {i} differs"
        # The load consumed the lease.
        assert _stats_daemon(engine_b)["leases_active"] == leases_before
        assert engine_b.release(hit.lease_id) is False


def test_prefix_load_and_partial_hit(daemon: RunningDaemon, arenas: list[ShmArena]) -> None:
    src = _engine_arena(NUM_BLOCKS, BLOCK_BYTES, fill_seed=21)
    dst = _engine_arena(NUM_BLOCKS, BLOCK_BYTES, fill_seed=None)
    arenas += [src, dst]
    chain = make_chain("prefix", NUM_BLOCKS, seed=5)
    with daemon.client() as c:
        reg_src, reg_dst = c.register(src.layout, "src"), c.register(dst.layout, "dst")
        # Save only the first 5 blocks: a lookup of all 8 hits exactly 5.
        c.save(reg_src, chain.namespace, range(5), chain.hashes[:5], chain.idents[:5])
        hit = c.lookup(chain.namespace, chain.hashes, chain.idents)
        assert hit.num_hit == 5
        assert c.load(reg_dst, hit.lease_id, [0, 1]) == 2  # a prefix of the lease
        assert dst.block(0) == src.block(0) and dst.block(1) == src.block(1)
        assert dst.block(2) == bytes(BLOCK_BYTES)
        # A wrong ident (same hash, other tokens) is a miss, never data.
        wrong = list(chain.idents)
        wrong[0] = wrong[0][:-1] + bytes([wrong[0][-1] ^ 1])
        assert c.lookup(chain.namespace, chain.hashes, wrong).num_hit == 0
        # No lease asked for: hit counted, nothing pinned.
        peek = c.lookup(chain.namespace, chain.hashes, chain.idents, lease_ttl_s=0)
        assert peek.num_hit == 5 and peek.lease_id is None


def test_out_of_range_block_ids_touch_nothing(daemon: RunningDaemon,
                                              arenas: list[ShmArena]) -> None:
    src = _engine_arena(NUM_BLOCKS, BLOCK_BYTES, fill_seed=31)
    arenas.append(src)
    chain = make_chain("out-of-range", 3, seed=9)
    with daemon.client() as c:
        reg = c.register(src.layout, "e")
        with pytest.raises(ClientError) as info:
            c.save(reg, chain.namespace, [0, 1, NUM_BLOCKS], chain.hashes, chain.idents)
        assert info.value.code == "bad_request" and "out of range" in info.value.message
        assert c.lookup(chain.namespace, chain.hashes, chain.idents).num_hit == 0
        c.save(reg, chain.namespace, [0, 1, 2], chain.hashes, chain.idents)
        hit = c.lookup(chain.namespace, chain.hashes, chain.idents)
        with pytest.raises(ClientError) as info:
            c.load(reg, hit.lease_id, [0, 99, 1])
        assert info.value.code == "bad_request"
        with pytest.raises(ClientError) as info:
            c.load(reg, hit.lease_id, [0, 1, 2, 3])  # more blocks than the lease holds
        assert info.value.code == "bad_request"
        assert c.release(hit.lease_id) is True


def test_registration_errors(daemon: RunningDaemon, arenas: list[ShmArena]) -> None:
    src = _engine_arena(NUM_BLOCKS, BLOCK_BYTES, fill_seed=41)
    arenas.append(src)
    with daemon.client() as c:
        cuda = KVLayout(4, (Region(b"\x00" * 64, 4 * BLOCK_BYTES, 0, BLOCK_BYTES, BLOCK_BYTES),),
                        device="cuda:0")
        with pytest.raises(ClientError) as info:
            c.register(cuda, "gpu-engine")
        # Without a GPU the daemon cannot map CUDA memory at all; with one, a zero handle is
        # refused when it is opened. Either way the registration fails and nothing is mapped.
        assert (info.value.code, "CUDA IPC" in info.value.message) in {
            ("unsupported", True), ("bad_request", True)}
        # A region names a file descriptor the frame did not carry.
        missing = KVLayout(1, (Region(1, 4096, 0, 4096, 4096),), fds=src.layout.fds)
        with pytest.raises(ClientError) as info:
            c.register(missing, "e")
        assert info.value.code == "bad_request" and "carried 1" in info.value.message
        too_big = KVLayout(1, (Region(0, 1 << 30, 0, 1 << 29, 1 << 29),), fds=src.layout.fds)
        with pytest.raises(ClientError) as info:
            c.register(too_big, "e")
        assert info.value.code == "bad_request" and "exceeds its memory" in info.value.message
        # Names are refused, whatever they name (nothing is opened).
        for name in ("kvstore-no-such-shm", "../../etc/passwd"):
            by_name = KVLayout(1, (Region(name, 4096, 0, 4096, 4096),))
            with pytest.raises(ClientError) as info:
                c.register(by_name, "e")
            assert info.value.code == "permission_denied" and "by shared-memory name" in \
                info.value.message
        with pytest.raises(ClientError) as info:
            c.register({"num_blocks": 1}, "e")
        assert info.value.code == "bad_request"
        with pytest.raises(ClientError) as info:
            c.save(12345, b"\x00" * 16, [0], [b"\x00" * 16], [b""])
        assert info.value.code == "not_found"


def test_leases_and_registrations_belong_to_their_connection(
        daemon: RunningDaemon, arenas: list[ShmArena]) -> None:
    src = _engine_arena(NUM_BLOCKS, BLOCK_BYTES, fill_seed=51)
    arenas.append(src)
    chain = make_chain("ownership", 2, seed=3)
    with daemon.client() as a, daemon.client() as b:
        reg = a.register(src.layout, "a")
        a.save(reg, chain.namespace, [0, 1], chain.hashes, chain.idents)
        hit = a.lookup(chain.namespace, chain.hashes, chain.idents)
        with pytest.raises(ClientError) as info:
            b.load(reg, hit.lease_id, [0])
        assert info.value.code == "not_found"
        assert b.release(hit.lease_id) is False
        assert a.release(hit.lease_id) is True


def test_ssd_tier_round_trip(make_daemon, tmp_path, arenas: list[ShmArena]) -> None:
    num_blocks, block_bytes = 48, 256 * 1024  # 12 MiB of blocks through a 4 MiB DRAM pool
    running = make_daemon(dram="4MiB", ssd_dir=tmp_path / "ssd", ssd_size="64MiB", http=False)
    src = _engine_arena(num_blocks, block_bytes, fill_seed=61)
    dst = _engine_arena(num_blocks, block_bytes, fill_seed=None)
    arenas += [src, dst]
    chain = make_chain("ssd-round-trip", num_blocks, seed=17)
    with running.client() as c:
        reg_src, reg_dst = c.register(src.layout, "src"), c.register(dst.layout, "dst")
        for start in range(0, num_blocks, 8):
            ids = list(range(start, start + 8))
            out = c.save(reg_src, chain.namespace, ids, chain.hashes[start:start + 8],
                         chain.idents[start:start + 8])
            assert out.outcomes == ["saved"] * 8
        assert wait_until(lambda: c.stats()["tiers"]["ssd"]["blocks"] >= num_blocks // 2)
        hit = c.lookup(chain.namespace, chain.hashes, chain.idents, lease_ttl_s=0)
        assert hit.num_hit == num_blocks
        assert "ssd" in hit.tiers and hit.tiers[0] == "ssd"
        # Promoted blocks stay pinned while their lease lives, so a restore larger than DRAM
        # goes lease by lease, 8 blocks (2 MiB) at a time.
        for start in range(0, num_blocks, 8):
            part = slice(start, start + 8)
            hit = c.lookup(chain.namespace, chain.hashes[part], chain.idents[part])
            assert hit.num_hit == 8
            assert c.load(reg_dst, hit.lease_id, range(start, start + 8)) == 8
        for i in range(num_blocks):
            assert dst.block(i) == src.block(i), f"block {i} differs after the SSD round trip"


def test_one_lease_larger_than_dram_loads_completely(make_daemon, tmp_path,
                                                    arenas: list[ShmArena]) -> None:
    # 48 blocks of 256 KiB (12 MiB) under one lease, restored through a 4 MiB DRAM pool: the
    # load lets go of each block once copied, so its DRAM goes to the next promotion.
    num_blocks, block_bytes = 48, 256 * 1024
    ssd_dir = tmp_path / "ssd"
    src = _engine_arena(num_blocks, block_bytes, fill_seed=67)
    dst = _engine_arena(num_blocks, block_bytes, fill_seed=None)
    arenas += [src, dst]
    chain = make_chain("lease-larger-than-dram", num_blocks, seed=19)
    first = make_daemon(dram="4MiB", ssd_dir=ssd_dir, ssd_size="64MiB", http=False)
    with first.client() as c:
        reg = c.register(src.layout, "src")
        for start in range(0, num_blocks, 8):
            part = slice(start, start + 8)
            out = c.save(reg, chain.namespace, range(start, start + 8), chain.hashes[part],
                         chain.idents[part])
            assert out.outcomes == ["saved"] * 8
    assert first.stop() == 0  # a graceful stop flushes what DRAM alone held
    second = make_daemon(dram="4MiB", ssd_dir=ssd_dir, ssd_size="64MiB", http=False)
    with second.client() as c:
        reg = c.register(dst.layout, "dst")
        hit = c.lookup(chain.namespace, chain.hashes, chain.idents)
        assert hit.num_hit == num_blocks and hit.tiers == ["ssd"] * num_blocks
        assert c.load(reg, hit.lease_id, range(num_blocks)) == num_blocks
        stats = c.stats()
        assert stats["counters"]["promotions"] == num_blocks
        assert stats["tiers"]["dram"]["used_bytes"] <= 4 << 20
        assert stats["daemon"]["leases_active"] == 0
    for i in range(num_blocks):
        assert dst.block(i) == src.block(i), f"block {i} differs after the restore"


def test_one_save_larger_than_dram_goes_through(make_daemon, arenas: list[ShmArena]) -> None:
    # 48 blocks of 256 KiB (12 MiB) in one save through a 4 MiB pool, no SSD: each block is
    # published before the next is reserved, so the later ones evict the earlier ones like any
    # put, and the newest stay.
    num_blocks, block_bytes = 48, 256 * 1024
    src = _engine_arena(num_blocks, block_bytes, fill_seed=73)
    dst = _engine_arena(8, block_bytes, fill_seed=None)
    arenas += [src, dst]
    chain = make_chain("save-larger-than-dram", num_blocks, seed=29)
    running = make_daemon(dram="4MiB", http=False)
    with running.client() as c:
        reg = c.register(src.layout, "src")
        out = c.save(reg, chain.namespace, range(num_blocks), chain.hashes, chain.idents)
        assert out.outcomes == ["saved"] * num_blocks
        counters = c.stats()["counters"]
        assert counters["puts"] == num_blocks and counters["aborts"] == 0
        tail = slice(num_blocks - 8, num_blocks)  # the newest blocks are the ones DRAM kept
        hit = c.lookup(chain.namespace, chain.hashes[tail], chain.idents[tail])
        assert hit.num_hit == 8
        reg_dst = c.register(dst.layout, "dst")
        assert c.load(reg_dst, hit.lease_id, range(8)) == 8
    for i in range(8):
        assert dst.block(i) == src.block(num_blocks - 8 + i), f"block {i} differs"


def test_damaged_ssd_block_fails_closed(make_daemon, tmp_path,
                                        arenas: list[ShmArena]) -> None:
    num_blocks, block_bytes = 32, 256 * 1024
    ssd_dir = tmp_path / "ssd"
    running = make_daemon(dram="4MiB", ssd_dir=ssd_dir, ssd_size="32MiB", http=False)
    src = _engine_arena(num_blocks, block_bytes, fill_seed=71)
    dst = _engine_arena(num_blocks, block_bytes, fill_seed=None)
    arenas += [src, dst]
    chain = make_chain("damaged", num_blocks, seed=23)
    with running.client() as c:
        reg_src, reg_dst = c.register(src.layout, "src"), c.register(dst.layout, "dst")
        c.save(reg_src, chain.namespace, range(num_blocks), chain.hashes, chain.idents)
        assert wait_until(lambda: c.lookup(chain.namespace, chain.hashes[:1], chain.idents[:1],
                                           lease_ttl_s=0).tiers == ["ssd"])
        for data_file in ssd_dir.glob("data-*.bin"):
            size = data_file.stat().st_size
            with open(data_file, "r+b") as f:
                f.write(np.full(size, 0xA5, np.uint8).tobytes())
        hit = c.lookup(chain.namespace, chain.hashes, chain.idents)
        assert hit.num_hit == num_blocks and hit.tiers[0] == "ssd"
        num_loaded = c.load(reg_dst, hit.lease_id, range(num_blocks))
        assert num_loaded == 0  # the first block is damaged: the hit shrinks to nothing
        assert dst.block(0) == bytes(block_bytes)  # and the engine's block was never written
        assert c.lookup(chain.namespace, chain.hashes[:1], chain.idents[:1]).num_hit == 0
