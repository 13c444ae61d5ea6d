"""Leases larger than DRAM: ``done`` lets go of each block once read, so a restore streams."""

from __future__ import annotations

import pytest
from store_helpers import NS, block_bytes, block_key

from kvstore.store.block_store import BlockUnavailable, StoreError, Tier

BLOCK = 16 * 1024
DRAM_BLOCKS = 4
NUM_BLOCKS = 6 * DRAM_BLOCKS


def _restarted_with_all_on_ssd(make_store, ssd_dir):
    """A store whose NUM_BLOCKS blocks are all on SSD and none in its (smaller) DRAM."""
    config = dict(dram_bytes=DRAM_BLOCKS * BLOCK, ssd_dir=ssd_dir, ssd_bytes=4 * NUM_BLOCKS * BLOCK)
    first = make_store(**config)
    for i in range(NUM_BLOCKS):
        assert first.put(NS, *block_key(i), block_bytes(i, BLOCK))
    first.flush_to_ssd()
    first.close()
    store = make_store(**config)
    assert store.stats()["tiers"]["ssd"]["blocks"] == NUM_BLOCKS
    assert store.stats()["tiers"]["dram"]["blocks"] == 0
    return store


def _lookup_all(store):
    keys = [block_key(i) for i in range(NUM_BLOCKS)]
    return store.lookup(NS, [h for h, _ in keys], [ident for _, ident in keys], lease_ttl_s=60)


def test_a_lease_over_more_ssd_blocks_than_dram_reads_through_with_done(make_store, tmp_path):
    store = _restarted_with_all_on_ssd(make_store, tmp_path / "ssd")
    result = _lookup_all(store)
    assert result.num_hit == NUM_BLOCKS and result.tiers == [Tier.SSD] * NUM_BLOCKS
    lease = result.lease
    for i in range(NUM_BLOCKS):
        assert bytes(store.read(lease, i)) == block_bytes(i, BLOCK), i
        store.done(lease, i)
        assert store.stats()["tiers"]["dram"]["pinned_blocks"] == 0
        store.check_integrity()
    c = store.stats()["counters"]
    assert c["promotions"] == NUM_BLOCKS and c["promotion_failures"] == 0
    assert c["lookup_blocks"] == c["hit_blocks_dram"] + c["hit_blocks_ssd"] + c["miss_blocks"]
    with pytest.raises(StoreError):
        store.read(lease, 0)  # let go of: its view may already hold another block
    store.done(lease, 0)  # idempotent
    lease.release()
    store.done(lease, 1)  # a no-op on a released lease
    store.check_integrity()
    # The blocks are all still there: the SSD copies were never dropped.
    for i in range(NUM_BLOCKS):
        assert store.get(NS, *block_key(i)) == block_bytes(i, BLOCK)


def test_read_addresses_stop_at_a_block_on_ssd_until_read_promotes_it(make_store, tmp_path):
    store = _restarted_with_all_on_ssd(make_store, tmp_path / "ssd")
    with _lookup_all(store).lease as lease:
        assert store.read_addresses(lease, 0, 3, BLOCK) == []  # on SSD: read promotes it
        store.read(lease, 0)
        assert len(store.read_addresses(lease, 0, 3, BLOCK)) == 1
        store.done_range(lease, 0, 1)
        assert store.stats()["tiers"]["dram"]["pinned_blocks"] == 0
    store.check_integrity()


def test_without_done_the_same_lease_runs_out_of_dram(make_store, tmp_path):
    store = _restarted_with_all_on_ssd(make_store, tmp_path / "ssd")
    with _lookup_all(store).lease as lease:
        for i in range(DRAM_BLOCKS):
            assert bytes(store.read(lease, i)) == block_bytes(i, BLOCK)
        with pytest.raises(BlockUnavailable):
            store.read(lease, DRAM_BLOCKS)  # every byte of DRAM is pinned by this lease
        store.done(lease, 0)
        assert bytes(store.read(lease, DRAM_BLOCKS)) == block_bytes(DRAM_BLOCKS, BLOCK)
        store.check_integrity()
    store.check_integrity()


def test_done_with_dram_blocks_unpins_them_one_by_one(make_store):
    store = make_store(dram_bytes=DRAM_BLOCKS * BLOCK)
    for i in range(DRAM_BLOCKS):
        assert store.put(NS, *block_key(i), block_bytes(i, BLOCK))
    keys = [block_key(i) for i in range(DRAM_BLOCKS)]
    lease = store.lookup(NS, [h for h, _ in keys], [ident for _, ident in keys]).lease
    assert store.stats()["tiers"]["dram"]["pinned_blocks"] == DRAM_BLOCKS
    with pytest.raises(StoreError):
        store.done(lease, DRAM_BLOCKS)  # no such block in the lease
    store.done(lease, 1)
    store.done(lease, 1)
    assert store.stats()["tiers"]["dram"]["pinned_blocks"] == DRAM_BLOCKS - 1
    # The unpinned block is the only one a new write can take the place of.
    assert store.put(NS, *block_key(99), block_bytes(99, BLOCK))
    assert store.get(NS, *block_key(1)) is None
    for i in (0, 2, 3):
        assert bytes(store.read(lease, i)) == block_bytes(i, BLOCK)
    store.check_integrity()
    lease.release()
    assert store.stats()["tiers"]["dram"]["pinned_blocks"] == 0
    store.check_integrity()


def test_a_fresh_lease_pins_against_every_way_a_block_can_leave_dram(make_store, tmp_path):
    # A lease's DRAM blocks are counted as pinned only when something asks: replacing, removing,
    # evicting and demoting must each ask first.
    store = make_store(dram_bytes=8 * BLOCK, ssd_dir=tmp_path / "ssd", ssd_bytes=64 * BLOCK)
    for i in range(4):
        assert store.put(NS, *block_key(i), block_bytes(i, BLOCK))
    keys = [block_key(i) for i in range(4)]
    lease = store.lookup(NS, [h for h, _ in keys], [ident for _, ident in keys]).lease
    h0, _ = block_key(0)
    assert store.put(NS, h0, b"another ident", block_bytes(50, BLOCK)) is False
    assert store.stats()["counters"]["put_collisions_dropped"] == 1
    assert store.remove(NS, block_key(1)[0]) is False
    for i in range(4, 40):  # far past DRAM: the rest is demoted or dropped around the lease
        assert store.put(NS, *block_key(i), block_bytes(i, BLOCK))
    store.check_integrity()
    for i in range(4):
        assert bytes(store.read(lease, i)) == block_bytes(i, BLOCK), i
    lease.release()
    store.check_integrity()
    assert store.stats()["tiers"]["dram"]["pinned_blocks"] == 0


def test_overlapping_leases_keep_their_blocks_until_the_last_lets_go(make_store):
    store = make_store(dram_bytes=8 * BLOCK)
    for i in range(4):
        assert store.put(NS, *block_key(i), block_bytes(i, BLOCK))
    keys = [block_key(i) for i in range(4)]
    first = store.lookup(NS, [h for h, _ in keys], [ident for _, ident in keys]).lease
    second = store.lookup(NS, [h for h, _ in keys[2:]], [ident for _, ident in keys[2:]]).lease
    store.check_integrity()  # counts both leases' pins
    third = store.lookup(NS, [h for h, _ in keys[:1]], [ident for _, ident in keys[:1]]).lease
    first.release()
    for i in range(4, 30):
        assert store.put(NS, *block_key(i), block_bytes(i, BLOCK))
    assert bytes(store.read(second, 1)) == block_bytes(3, BLOCK)
    assert bytes(store.read(third, 0)) == block_bytes(0, BLOCK)
    assert store.get(NS, *block_key(1)) is None  # only first held it: evicted since
    store.check_integrity()
    second.release()
    third.release()
    assert store.stats()["tiers"]["dram"]["pinned_blocks"] == 0
    store.check_integrity()
