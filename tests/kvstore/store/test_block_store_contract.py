"""The ``BlockStore`` contract, run against every arrangement of the tiered store's tiers.

What the daemon's verbs rely on, whatever the tiers are: byte-exact round trips, verified
prefixes, leases that pin, writes invisible until commit, counted outcomes that add up, the
``/stats`` keys, drop listeners and the flush. One test per promise, each run against DRAM alone
(the SSD tier switched off) and DRAM over SSD, the way cachetools runs one test class against
every cache. Only the ``BlockStore`` verbs are used here; what one arrangement does apart lives
in its own tests.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from store_helpers import NS, block_bytes, block_key

from kvstore.store.block_store import BlockStore, StoreError, Tier

BLOCK = 16 * 1024
DRAM_BLOCKS = 8
pytestmark = pytest.mark.timeout(60)  # a listener called under the store's lock would hang

ARRANGEMENTS = {
    "dram": {},
    "dram+ssd": {"ssd_bytes": 64 * BLOCK},
}


@pytest.fixture(params=sorted(ARRANGEMENTS))
def store(request, make_store, tmp_path) -> BlockStore:
    extra = dict(ARRANGEMENTS[request.param])
    if extra:
        extra["ssd_dir"] = tmp_path / "ssd"
    return make_store(dram_bytes=DRAM_BLOCKS * BLOCK, **extra)


def chain(indices) -> tuple[list[bytes], list[bytes]]:
    keys = [block_key(i) for i in indices]
    return [h for h, _ in keys], [ident for _, ident in keys]


def put(store: BlockStore, i: int) -> bool:
    return store.put(NS, *block_key(i), block_bytes(i, BLOCK))


def test_a_put_comes_back_byte_exact_once_stored(store) -> None:
    assert put(store, 1) is True
    assert put(store, 1) is False  # an equal block was there: idempotent
    h, ident = block_key(1)
    assert store.get(NS, h, ident) == block_bytes(1, BLOCK)
    assert store.get(NS, h, b"another ident") is None  # a collision is a miss, never data
    store.check_integrity()


def test_a_lookup_returns_the_verified_prefix_and_its_counts_add_up(store) -> None:
    for i in range(3):
        put(store, i)
    hashes, idents = chain(range(5))
    result = store.lookup(NS, hashes, idents, lease_ttl_s=None)
    assert (result.num_hit, result.lease) == (3, None)
    assert len(result.tiers) == 3 and all(isinstance(t, Tier) for t in result.tiers)
    idents[1] = b"not the block asked for"
    assert store.lookup(NS, hashes, idents, lease_ttl_s=None).num_hit == 1
    stats = store.stats()
    c, tiers = stats["counters"], stats["tiers"]
    assert c["lookup_blocks"] == 10
    assert c["lookup_blocks"] == tiers["dram"]["hits"] + tiers["ssd"]["hits"] + c["miss_blocks"]
    store.check_integrity()


def test_stats_name_every_tier_with_its_capacity_use_and_blocks(store) -> None:
    put(store, 0)
    tiers = store.stats()["tiers"]
    for name in ("dram", "ssd"):
        assert {"capacity_bytes", "used_bytes", "blocks", "hits"} <= set(tiers[name])
        assert 0 <= tiers[name]["used_bytes"] <= tiers[name]["capacity_bytes"]
    assert tiers["dram"]["blocks"] == 1 and tiers["dram"]["used_bytes"] >= BLOCK


def test_a_probe_leaves_no_trace(store) -> None:
    for i in range(2):
        put(store, i)
    hashes, idents = chain(range(3))
    before = store.stats()
    assert store.probe(NS, hashes, idents) == [Tier.DRAM, Tier.DRAM]
    assert store.stats() == before
    assert store.lookup(NS, hashes, idents, lease_ttl_s=None).tiers == [Tier.DRAM, Tier.DRAM]


def test_a_lease_pins_its_blocks_until_released(store) -> None:
    put(store, 0)
    hashes, idents = chain([0])
    lease = store.lookup(NS, hashes, idents, lease_ttl_s=60).lease
    assert lease is not None and lease.tiers == [Tier.DRAM]
    for i in range(1, 4 * DRAM_BLOCKS):  # four pools' worth: every other block may go
        put(store, i)
    assert store.remove(NS, hashes[0]) is False
    assert bytes(store.read(lease, 0)) == block_bytes(0, BLOCK)
    store.check_integrity()
    store.release(lease)
    store.release(lease)  # idempotent
    with pytest.raises(StoreError):
        store.read(lease, 0)
    assert store.remove(NS, hashes[0]) is True
    assert store.get(NS, *block_key(0)) is None
    store.check_integrity()


def test_done_lets_go_of_one_block_and_a_later_read_of_it_fails(store) -> None:
    for i in range(2):
        put(store, i)
    hashes, idents = chain(range(2))
    lease = store.lookup(NS, hashes, idents, lease_ttl_s=60).lease
    store.done(lease, 0)
    store.done(lease, 0)  # idempotent
    with pytest.raises(StoreError):
        store.read(lease, 0)
    assert bytes(store.read(lease, 1)) == block_bytes(1, BLOCK)
    store.release(lease)
    store.done(lease, 1)  # a no-op on a released lease
    store.check_integrity()


def test_read_addresses_are_the_views_and_stop_where_read_must_go_on(store) -> None:
    for i in range(4):
        put(store, i)
    lease = store.lookup(NS, *chain(range(4)), lease_ttl_s=60).lease
    views = [memoryview_address(store.read(lease, i)) for i in range(4)]
    assert store.read_addresses(lease, 0, 4, BLOCK) == views
    assert store.read_addresses(lease, 2, 2, BLOCK) == views[2:]
    assert store.read_addresses(lease, 0, 4, BLOCK + 1) == []  # stored under another size
    store.done(lease, 1)
    assert store.read_addresses(lease, 0, 4, BLOCK) == views[:1]  # done: read says why
    for start, count in ((3, 2), (-1, 1), (0, 0), (4, 1)):
        with pytest.raises(StoreError, match="has no blocks"):
            store.read_addresses(lease, start, count, BLOCK)
    store.release(lease)
    with pytest.raises(StoreError):
        store.read_addresses(lease, 0, 1, BLOCK)
    store.check_integrity()


def test_done_range_lets_go_of_a_range_at_once(store) -> None:
    for i in range(4):
        put(store, i)
    lease = store.lookup(NS, *chain(range(4)), lease_ttl_s=60).lease
    with pytest.raises(StoreError, match="has no blocks"):
        store.done_range(lease, 2, 3)
    store.done_range(lease, 1, 2)
    store.done_range(lease, 1, 2)  # idempotent
    for i in (1, 2):
        with pytest.raises(StoreError):
            store.read(lease, i)
    assert bytes(store.read(lease, 3)) == block_bytes(3, BLOCK)
    assert store.stats()["tiers"]["dram"]["pinned_blocks"] == 2
    store.release(lease)
    store.done_range(lease, 0, 4)  # a no-op on a released lease
    assert store.stats()["tiers"]["dram"]["pinned_blocks"] == 0
    store.check_integrity()


def test_a_write_slot_names_its_buffer_address(store) -> None:
    slot = store.begin_write(NS, *block_key(5), BLOCK)
    assert slot.address == memoryview_address(slot.buffer)
    slot.abort()


def test_expired_leases_are_released(store) -> None:
    put(store, 0)
    lease = store.lookup(NS, *chain([0]), lease_ttl_s=5).lease
    assert store.expire_leases(now=time.monotonic()) == 0
    assert store.expire_leases(now=time.monotonic() + 10) == 1
    assert lease.released
    with pytest.raises(StoreError):
        store.read(lease, 0)
    store.check_integrity()


def test_a_write_is_invisible_until_commit_and_gone_after_abort(store) -> None:
    h, ident = block_key(7)
    slot = store.begin_write(NS, h, ident, BLOCK)
    slot.buffer[:] = block_bytes(7, BLOCK)
    assert store.lookup(NS, [h], [ident], lease_ttl_s=None).num_hit == 0
    assert store.holding(NS, [h]) == [True]  # being written counts as held
    assert store.begin_write(NS, h, ident, BLOCK) is None  # the first writer goes on
    slot.abort()
    assert store.holding(NS, [h]) == [False]
    slot = store.begin_write(NS, h, ident, BLOCK)
    slot.buffer[:] = block_bytes(7, BLOCK)
    assert slot.commit() is True
    assert store.get(NS, h, ident) == block_bytes(7, BLOCK)
    store.check_integrity()


def test_replace_swaps_the_bytes_under_a_key(store) -> None:
    h, ident = block_key(3)
    assert store.replace(NS, h, ident, block_bytes(3, BLOCK)) is False  # nothing was there
    assert store.replace(NS, h, b"new ident", block_bytes(4, BLOCK)) is True
    assert store.get(NS, h, ident) is None
    assert store.get(NS, h, b"new ident") == block_bytes(4, BLOCK)
    store.check_integrity()


def test_holding_answers_per_hash(store) -> None:
    put(store, 0)
    hashes, _ = chain(range(2))
    assert store.holding(NS, hashes) == [True, False]


def test_read_views_lie_in_the_host_spans(store) -> None:
    put(store, 0)
    with store.lookup(NS, *chain([0])).lease as lease:
        view = store.read(lease, 0)
        start = memoryview_address(view)
        assert any(lo <= start and start + BLOCK <= hi for lo, hi in store.host_spans())


def test_more_than_dram_holds_is_the_bytes_put_or_nothing(store) -> None:
    num_blocks = 3 * DRAM_BLOCKS
    for i in range(num_blocks):
        put(store, i)
    for i in range(num_blocks):
        got = store.get(NS, *block_key(i))
        assert got is None or got == block_bytes(i, BLOCK), i
    assert store.get(NS, *block_key(num_blocks - 1)) is not None  # the newest stays
    store.check_integrity()


class Drops:
    """A drop listener: records what it is told, and that the store's lock was not held."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.hashes: list[bytes] = []

    def __call__(self, namespace: bytes, block_hashes: list[bytes]) -> None:
        assert namespace == NS
        # Outside the store's lock: the listener may call the store.
        assert self.store.holding(namespace, block_hashes) == [False] * len(block_hashes)
        self.hashes += block_hashes


def test_every_drop_listener_hears_of_blocks_that_left_every_tier(store) -> None:
    first, second = Drops(store), Drops(store)
    store.add_drop_listener(first)

    def broken(namespace: bytes, block_hashes: list[bytes]) -> None:
        raise RuntimeError("listener bug")

    store.add_drop_listener(broken)  # its failure fails neither the store nor the others
    store.add_drop_listener(second)
    for i in range(3):
        put(store, i)
    hashes, _ = chain(range(3))
    assert store.remove(NS, hashes[0]) is True
    assert first.hashes == second.hashes == [hashes[0]]
    store.remove_drop_listener(first)
    store.remove_drop_listener(first)  # harmless when not listening
    assert store.remove(NS, hashes[1]) is True
    assert first.hashes == [hashes[0]] and second.hashes == hashes[:2]
    assert store.remove(NS, hashes[1]) is False  # nothing left: nothing told
    assert second.hashes == hashes[:2]


def test_flush_to_ssd_writes_what_only_dram_holds(store) -> None:
    for i in range(3):
        put(store, i)
    has_ssd = store.stats()["tiers"]["ssd"]["capacity_bytes"] > 0
    assert store.flush_to_ssd() == (3 if has_ssd else 0)
    assert store.flush_to_ssd() == 0  # the SSD holds them now (or there is none)
    assert store.stats()["tiers"]["ssd"]["blocks"] == (3 if has_ssd else 0)
    for i in range(3):
        assert store.get(NS, *block_key(i)) == block_bytes(i, BLOCK)


def test_a_closed_store_refuses_and_closing_again_is_harmless(store) -> None:
    put(store, 0)
    store.close()
    store.close()
    with pytest.raises(StoreError):
        store.lookup(NS, *chain([0]))


def memoryview_address(view: memoryview) -> int:
    """The address of the first byte of ``view`` (NumPy reads it without copying)."""
    return np.frombuffer(view, np.uint8).ctypes.data
