"""TieredStore contracts: byte-exact round trips, leases, in-flight writes, demotion, promotion."""

from __future__ import annotations

import threading
import time

import pytest
from daemon_helpers import wait_until
from store_helpers import NS, block_bytes, block_key

from kvstore.store.block_store import BlockUnavailable, StoreError, Tier
from kvstore.store.tiered import StoreConfig

KIB = 1024
BLOCK = 16 * KIB  # four 4 KiB units per block


def put_blocks(store, indices, size=BLOCK):
    for i in indices:
        h, ident = block_key(i)
        assert store.put(NS, h, ident, block_bytes(i, size))


def get_block(store, i):
    h, ident = block_key(i)
    return store.get(NS, h, ident)


def test_config_is_validated_once():
    with pytest.raises(ValueError):
        StoreConfig(dram_bytes=1 << 20, demote_low_watermark=0.9, demote_high_watermark=0.5)
    with pytest.raises(ValueError):
        StoreConfig(dram_bytes=1 << 20, eviction="random")
    with pytest.raises(ValueError):
        StoreConfig(dram_bytes=0)
    cfg = StoreConfig(dram_bytes=1 << 20, ssd_dir="/nonexistent", ssd_bytes=0)
    assert not cfg.ssd_enabled and str(cfg.ssd_dir) == "/nonexistent"


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 100_000])
def test_put_get_is_byte_exact(make_store, size):
    store = make_store(dram_bytes=1 << 20)
    h, ident = block_key(1)
    data = block_bytes(1, size)
    assert store.put(NS, h, ident, data) is True
    assert store.put(NS, h, ident, data) is False  # idempotent, counted
    assert store.get(NS, h, ident) == data
    stats = store.stats()
    assert stats["counters"]["puts"] == 1 and stats["counters"]["duplicate_puts"] == 1
    assert stats["tiers"]["dram"]["blocks"] == 1 and stats["tiers"]["ssd"]["enabled"] is False
    store.check_integrity()


def test_lookup_returns_the_verified_prefix_and_counts_add_up(make_store):
    store = make_store(dram_bytes=1 << 20)
    put_blocks(store, [0, 1])
    keys = [block_key(i) for i in range(4)]
    result = store.lookup(NS, [h for h, _ in keys], [ident for _, ident in keys])
    assert result.num_hit == 2 and result.tiers == [Tier.DRAM, Tier.DRAM]
    assert result.lease.block_hashes == [keys[0][0], keys[1][0]]
    assert bytes(store.read(result.lease, 1)) == block_bytes(1, BLOCK)
    result.lease.release()
    h, _ = keys[0]
    assert store.lookup(NS, [h], [b"wrong ident"]).num_hit == 0  # a verified miss
    c = store.stats()["counters"]
    assert c["lookup_blocks"] == c["hit_blocks_dram"] + c["hit_blocks_ssd"] + c["miss_blocks"]
    assert c["collisions"] == 1 and c["hit_blocks_dram"] == 2 and c["miss_blocks"] == 3


def test_read_views_are_read_only(make_store):
    store = make_store(dram_bytes=1 << 20)
    put_blocks(store, [0])
    h, ident = block_key(0)
    with store.lookup(NS, [h], [ident]).lease as lease:
        view = store.read(lease, 0)
        with pytest.raises(TypeError):
            view[0] = 1


def test_lease_blocks_eviction_until_released(make_store):
    store = make_store(dram_bytes=8 * BLOCK)
    put_blocks(store, [0])
    h, ident = block_key(0)
    lease = store.lookup(NS, [h], [ident], lease_ttl_s=60).lease
    put_blocks(store, range(1, 40))  # five times the pool: everything else is evicted
    assert store.stats()["counters"]["evictions"] >= 30
    assert bytes(store.read(lease, 0)) == block_bytes(0, BLOCK)
    store.check_integrity()
    lease.release()
    lease.release()  # idempotent
    with pytest.raises(StoreError):
        store.read(lease, 0)
    put_blocks(store, range(40, 60))
    assert get_block(store, 0) is None  # unpinned, it went the LRU way
    store.check_integrity()


def test_expired_leases_are_released(make_store):
    store = make_store(dram_bytes=4 * BLOCK)
    put_blocks(store, range(4))
    keys = [block_key(i) for i in range(4)]
    lease = store.lookup(NS, [h for h, _ in keys], [i for _, i in keys], lease_ttl_s=5).lease
    assert store.stats()["tiers"]["dram"]["pinned_blocks"] == 4
    assert store.expire_leases(now=time.monotonic()) == 0
    assert store.expire_leases(now=time.monotonic() + 10) == 1
    assert lease.released and store.stats()["leases"] == 0
    with pytest.raises(StoreError):
        store.read(lease, 0)
    put_blocks(store, range(4, 8))  # nothing pinned any more: room is made
    store.check_integrity()


def test_a_lease_being_read_neither_expires_nor_lets_go_until_the_copy_ends(make_store):
    """A load's copies read the lease's DRAM in flight: past its deadline, or released by its
    owner meanwhile, its blocks stay pinned (a full pool refuses a write rather than reuse
    them) and further reads fail; the pins go, counted, when the reading ends."""
    store = make_store(dram_bytes=4 * BLOCK)
    put_blocks(store, range(4))
    keys = [block_key(i) for i in range(4)]
    for how in ("expiry", "release"):
        lease = store.lookup(NS, [h for h, _ in keys], [i for _, i in keys],
                             lease_ttl_s=0.2).lease
        with store.reading(lease):
            view = store.read(lease, 0)  # a copy out of this view is in flight
            if how == "expiry":
                time.sleep(0.25)
                assert store.expire_leases(now=time.monotonic() + 10) == 0
            else:
                lease.release()
            h, ident = block_key(50)
            with pytest.raises(StoreError):  # every block pinned: nothing may be evicted
                store.begin_write(NS, h, ident, BLOCK)
            assert bytes(view) == block_bytes(0, BLOCK)
            with pytest.raises(StoreError):
                store.read(lease, 1)  # fail closed: past its deadline or released
            assert store.stats()["tiers"]["dram"]["pinned_blocks"] == 4
        assert lease.released and store.stats()["leases"] == 0
        assert store.stats()["tiers"]["dram"]["pinned_blocks"] == 0
        store.check_integrity()
    counters = store.stats()["counters"]
    assert counters["leases_expired_after_reading"] == 1
    assert counters["lease_releases_deferred"] == 1
    put_blocks(store, range(4, 8))  # room is made again
    store.check_integrity()


def test_all_pinned_or_too_large_raises(make_store):
    store = make_store(dram_bytes=4 * BLOCK)
    put_blocks(store, range(4))
    keys = [block_key(i) for i in range(4)]
    lease = store.lookup(NS, [h for h, _ in keys], [i for _, i in keys], lease_ttl_s=60).lease
    h, ident = block_key(99)
    with pytest.raises(StoreError):
        store.begin_write(NS, h, ident, BLOCK)
    with pytest.raises(StoreError):
        store.begin_write(NS, h, ident, 5 * BLOCK)
    lease.release()
    assert store.put(NS, h, ident, block_bytes(99, BLOCK))
    store.check_integrity()


def test_in_flight_block_is_invisible_until_commit(make_store):
    store = make_store(dram_bytes=1 << 20)
    h, ident = block_key(5)
    data = block_bytes(5, BLOCK)
    slot = store.begin_write(NS, h, ident, BLOCK)
    slot.buffer[:] = data
    assert store.lookup(NS, [h], [ident]).num_hit == 0
    assert store.begin_write(NS, h, ident, BLOCK) is None  # a second writer defers to the first
    assert store.remove(NS, h) is False  # in flight: not removable
    assert store.stats()["tiers"]["dram"]["in_flight_blocks"] == 1
    store.check_integrity()
    assert slot.commit() is True
    assert slot.commit() is False
    assert store.get(NS, h, ident) == data


def test_abort_frees_the_reservation(make_store):
    store = make_store(dram_bytes=1 << 20)
    h, ident = block_key(6)
    slot = store.begin_write(NS, h, ident, BLOCK)
    slot.buffer[:] = block_bytes(6, BLOCK)
    slot.abort()
    assert store.stats()["tiers"]["dram"]["used_bytes"] == 0
    assert store.get(NS, h, ident) is None
    assert store.stats()["counters"]["aborts"] == 1
    store.check_integrity()


def test_remove_respects_pins(make_store):
    store = make_store(dram_bytes=1 << 20)
    put_blocks(store, [1])
    h, ident = block_key(1)
    lease = store.lookup(NS, [h], [ident]).lease
    assert store.remove(NS, h) is False
    lease.release()
    assert store.remove(NS, h) is True
    assert store.get(NS, h, ident) is None
    store.check_integrity()


def test_demotion_to_ssd_then_promotion_is_byte_exact(make_store, tmp_path):
    store = make_store(dram_bytes=16 * BLOCK, ssd_dir=tmp_path / "ssd", ssd_bytes=128 * BLOCK)
    put_blocks(store, range(60))  # almost four times DRAM
    ssd_stats = lambda: store.stats()["tiers"]["ssd"]  # noqa: E731
    assert wait_until(lambda: store.stats()["tiers"]["dram"]["used_bytes"] <= 0.9 * 16 * BLOCK)
    assert store.stats()["counters"]["demotions"] >= 44
    assert store.stats()["counters"]["evictions"] == 0  # nothing lost: it went to SSD
    assert ssd_stats()["blocks"] >= 44
    store.check_integrity()
    for i in range(60):
        assert get_block(store, i) == block_bytes(i, BLOCK), i
    c = store.stats()["counters"]
    assert c["hit_blocks_ssd"] >= 44 and c["promotions"] >= 44
    store.check_integrity()


def test_ssd_hit_through_a_lease_is_promoted_into_dram(make_store, tmp_path):
    store = make_store(dram_bytes=16 * BLOCK, ssd_dir=tmp_path / "ssd", ssd_bytes=64 * BLOCK)
    put_blocks(store, [0])
    assert store.flush_to_ssd() == 1
    put_blocks(store, range(1, 40))  # block 0 leaves DRAM (it is clean: released without IO)
    assert wait_until(lambda: store.lookup(NS, [block_key(0)[0]], [block_key(0)[1]],
                                         lease_ttl_s=None).tiers == [Tier.SSD])
    h, ident = block_key(0)
    result = store.lookup(NS, [h], [ident])
    assert result.tiers == [Tier.SSD]
    assert bytes(store.read(result.lease, 0)) == block_bytes(0, BLOCK)
    assert bytes(store.read(result.lease, 0)) == block_bytes(0, BLOCK)  # second read: DRAM
    result.lease.release()
    again = store.lookup(NS, [h], [ident], lease_ttl_s=None)
    assert again.tiers == [Tier.DRAM]
    store.check_integrity()


def test_ssd_size_cap_is_held_by_evicting_the_oldest(make_store, tmp_path):
    store = make_store(dram_bytes=8 * BLOCK, ssd_dir=tmp_path / "ssd", ssd_bytes=12 * BLOCK)
    for start in range(0, 60, 6):
        put_blocks(store, range(start, start + 6))
        store.flush_to_ssd()
        ssd = store.stats()["tiers"]["ssd"]
        assert ssd["used_bytes"] <= ssd["capacity_bytes"] == 12 * BLOCK
    ssd = store.stats()["tiers"]["ssd"]
    assert ssd["counters"]["evictions"] >= 60 - 12 and ssd["blocks"] <= 12
    served = [i for i in range(60) if get_block(store, i) is not None]
    assert served and min(served) >= 60 - 12 - 8  # what is left is the newest
    for i in served:
        assert get_block(store, i) == block_bytes(i, BLOCK)
    store.check_integrity()


def test_block_larger_than_the_ssd_stays_in_dram(make_store, tmp_path):
    store = make_store(dram_bytes=16 * BLOCK, ssd_dir=tmp_path / "ssd", ssd_bytes=2 * BLOCK)
    put_blocks(store, [0], size=4 * BLOCK)
    assert store.flush_to_ssd() == 0
    assert get_block(store, 0) == block_bytes(0, 4 * BLOCK)
    assert store.stats()["tiers"]["ssd"]["counters"]["write_rejected"] >= 1
    store.check_integrity()


def test_damaged_ssd_block_read_through_a_lease_is_unavailable(make_store, tmp_path):
    store = make_store(dram_bytes=4 * BLOCK, ssd_dir=tmp_path / "ssd", ssd_bytes=32 * BLOCK)
    put_blocks(store, range(12))
    store.flush_to_ssd()
    assert wait_until(lambda: store.stats()["tiers"]["dram"]["blocks"] <= 3)
    victim = next(i for i in range(12)
                  if store.lookup(NS, [block_key(i)[0]], [block_key(i)[1]],
                                  lease_ttl_s=None).tiers == [Tier.SSD])
    h, ident = block_key(victim)
    path, offset, _ = store.ssd_tier.locate(NS + h)
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = store.lookup(NS, [h], [ident])
    with pytest.raises(BlockUnavailable):
        store.read(result.lease, 0)
    result.lease.release()
    assert store.get(NS, h, ident) is None  # dropped: a plain miss from now on
    ssd = store.stats()["tiers"]["ssd"]
    assert ssd["counters"]["corrupt"] == 1
    store.check_integrity()


def test_concurrent_writers_and_readers_only_ever_see_their_bytes(make_store, tmp_path):
    store = make_store(dram_bytes=12 * BLOCK, ssd_dir=tmp_path / "ssd", ssd_bytes=40 * BLOCK)
    errors: list[str] = []

    def worker(base: int) -> None:
        try:
            for n in range(60):
                i = base + n % 30
                h, ident = block_key(i)
                store.put(NS, h, ident, block_bytes(i, BLOCK))
                got = store.get(NS, *block_key(base + (n * 7) % 30))
                if got is not None and got != block_bytes(base + (n * 7) % 30, BLOCK):
                    errors.append(f"wrong bytes for {base + (n * 7) % 30}")
        except Exception as exc:  # surfaced below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    store.check_integrity()
    c = store.stats()["counters"]
    assert c["lookup_blocks"] == c["hit_blocks_dram"] + c["hit_blocks_ssd"] + c["miss_blocks"]


def test_integrity_holds_while_a_promotion_reads_from_ssd(make_store, tmp_path):
    # A block being read from SSD owns DRAM before it is published: the check must count it.
    size, num = 256 * KIB, 48
    store = make_store(dram_bytes=12 * size, ssd_dir=tmp_path / "ssd", ssd_bytes=64 * size)
    put_blocks(store, range(num), size)
    keys = [block_key(i) for i in range(num)]
    hashes, idents = [k[0] for k in keys], [k[1] for k in keys]
    assert wait_until(lambda: store.lookup(NS, hashes[:8], idents[:8], lease_ttl_s=None).tiers
                      == [Tier.SSD] * 8)
    wrong: list[int] = []
    seen_in_flight = 0
    # A pass whose promotions all slipped between two polls (a loaded runner) is read again:
    # the pool holds 12 of the 48 blocks, so each pass promotes most of them from SSD anew.
    for _ in range(5):
        result = store.lookup(NS, hashes, idents)
        done = threading.Event()

        def reader(lease=result.lease, done=done) -> None:
            try:
                for i in range(num):
                    if bytes(store.read(lease, i)) != block_bytes(i, size):
                        wrong.append(i)
                    store.done(lease, i)
            finally:
                done.set()

        thread = threading.Thread(target=reader)
        thread.start()
        while not done.is_set():
            seen_in_flight += store.stats()["tiers"]["dram"]["promoting_blocks"]
            store.check_integrity()
        thread.join(10)
        result.lease.release()
        if seen_in_flight:
            break
    assert not wrong and seen_in_flight > 0
    store.check_integrity()
