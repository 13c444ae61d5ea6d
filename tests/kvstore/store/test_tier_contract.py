"""The tier contract (``kvstore/store/store_tier.py``), run against every tier.

The DRAM tier, the SSD tier and the null tier (the backing tier when there is no SSD) each pass
the same tests, the way cachetools runs one test class against every cache; the backing tiers
(SSD and null) also pass the backing tier's. How a block gets into a tier and how a tier comes
under pressure differ (DRAM: the write path reserves and publishes, the demoter drops victims;
a backing tier: ``write_many``), so each tier has a small side that does those two things the
way the store does; everything else is the contract's verbs.
"""

from __future__ import annotations

import pytest
from store_helpers import NS, block_bytes, block_key

from kvstore.store.dram.pool import HostPool
from kvstore.store.dram.tier import DramTier
from kvstore.store.eviction import make_policy
from kvstore.store.null_tier import NullTier
from kvstore.store.ssd.tier import SSDTier
from kvstore.store.store_tier import BackingTier, BlockWrite, StoreTier
from kvstore.tiers import Tier

BLOCK = 16 * 1024
NUM_BLOCKS = 8  # each tier holds this many blocks


def key_of(i: int) -> tuple[bytes, bytes]:
    """(index key, ident) of block ``i``."""
    h, ident = block_key(i)
    return NS + h, ident


class Side:
    """One tier and the two things the store does to it apart from the contract's verbs."""

    tier: StoreTier

    def put(self, i: int):
        """Store block ``i`` the way the store does; the tier's entry, or None if refused."""
        raise NotImplementedError

    def crowd(self, num_blocks: int) -> None:
        """Make room for ``num_blocks`` more, the way pressure does (the tier's victims go)."""
        raise NotImplementedError

    def read(self, entry) -> bytes:
        raise NotImplementedError


class DramSide(Side):
    def __init__(self, tmp_path) -> None:
        self.tier = DramTier(HostPool(NUM_BLOCKS * BLOCK, 4096, pin=False), make_policy("lru"))

    def put(self, i: int):
        alloc = self.tier.pool.allocate(BLOCK)
        if alloc is None:
            return None
        block = self.tier.reserve(*key_of(i), alloc)  # the write path: reserve, fill, publish
        self.tier.view(block, padded=True)[:BLOCK] = block_bytes(i, BLOCK)
        self.tier.publish(block)
        return block

    def crowd(self, num_blocks: int) -> None:
        victims = list(self.tier.victims())[:num_blocks]  # the demoter: collect, then drop
        for block in victims:
            self.tier.drop(block)

    def read(self, entry) -> bytes:
        return bytes(self.tier.view(entry))


class BackingSide(Side):
    tier: BackingTier

    def __init__(self) -> None:
        self.dropped: list[bytes] = []
        self._next_crowd = 1000

    def put(self, i: int):
        key, ident = key_of(i)
        self.tier.write_many([BlockWrite(key, ident, memoryview(block_bytes(i, BLOCK)), BLOCK)])
        return self.tier.lookup(key)

    def crowd(self, num_blocks: int) -> None:
        for _ in range(num_blocks):  # new blocks push the oldest unpinned ones out
            self.put(self._next_crowd)
            self._next_crowd += 1

    def read(self, entry) -> bytes:
        buf = bytearray(BLOCK + 4096)  # room for an O_DIRECT read's padding
        assert self.tier.read_into(entry, memoryview(buf))
        return bytes(buf[:BLOCK])


class SsdSide(BackingSide):
    def __init__(self, tmp_path) -> None:
        super().__init__()
        self.tier = SSDTier(tmp_path / "ssd", NUM_BLOCKS * BLOCK, on_drop=self.dropped.append)


class NullSide(BackingSide):
    def __init__(self, tmp_path) -> None:
        super().__init__()
        self.tier = NullTier()


SIDES = {"dram": DramSide, "ssd": SsdSide, "null": NullSide}


@pytest.fixture(params=sorted(SIDES))
def side(request, tmp_path):
    made = SIDES[request.param](tmp_path)
    yield made
    made.tier.close()


@pytest.fixture(params=["null", "ssd"])
def backing(request, tmp_path):
    made = SIDES[request.param](tmp_path)
    yield made
    made.tier.close()


def holds_blocks(side: Side) -> bool:
    return side.tier.stats()["capacity_bytes"] > 0


# -- every tier ------------------------------------------------------------------------------


def test_an_empty_tier_holds_nothing_and_says_so(side) -> None:
    tier = side.tier
    assert isinstance(tier.tier, Tier)
    stats = tier.stats()
    assert all(isinstance(stats[k], int) for k in ("capacity_bytes", "used_bytes", "blocks"))
    assert (stats["used_bytes"], stats["blocks"]) == (0, 0)
    key, _ = key_of(1)
    assert tier.lookup(key) is None and key not in tier
    tier.touch_many([None])
    assert tier.pin_many([]) == 0
    tier.check_integrity()


def test_a_stored_block_is_found_under_its_key(side) -> None:
    tier = side.tier
    entry = side.put(1)
    key, ident = key_of(1)
    stats = tier.stats()
    if entry is None:  # a tier refuses a block only when it has no room at all
        assert stats["capacity_bytes"] == 0 and stats["blocks"] == 0 and key not in tier
        return
    assert (entry.key, entry.ident) == (key, ident)
    assert tier.lookup(key) is entry and key in tier
    assert stats["blocks"] == 1 and BLOCK <= stats["used_bytes"] <= stats["capacity_bytes"]
    assert side.read(entry) == block_bytes(1, BLOCK)
    tier.check_integrity()


def test_a_pinned_block_outlives_pressure_and_goes_once_unpinned(side) -> None:
    tier = side.tier
    entry = side.put(1)
    if entry is None:
        assert not holds_blocks(side)
        return
    key, _ = key_of(1)
    assert tier.pin_many([entry]) == 1
    side.crowd(2 * NUM_BLOCKS)
    assert tier.lookup(key) is entry
    tier.check_integrity()
    tier.unpin(entry)
    side.crowd(2 * NUM_BLOCKS)
    assert key not in tier
    assert tier.pin_many([entry]) == 0  # dropped meanwhile: nothing to pin
    tier.check_integrity()


def test_a_touched_block_is_the_last_to_go(side) -> None:
    tier = side.tier
    entries = [side.put(i) for i in range(NUM_BLOCKS)]
    if entries[0] is None:
        assert not holds_blocks(side)
        return
    tier.touch_many([entries[0], None])
    side.crowd(1)
    assert key_of(0)[0] in tier and key_of(1)[0] not in tier
    tier.check_integrity()


def test_closing_twice_is_harmless(side) -> None:
    side.tier.close()
    side.tier.close()


# -- every backing tier ----------------------------------------------------------------------


def test_a_backing_tier_is_enabled_exactly_when_it_takes_blocks(backing) -> None:
    tier = backing.tier
    assert tier.stats()["enabled"] is tier.enabled
    results = tier.write_many([BlockWrite(*key_of(i), memoryview(block_bytes(i, BLOCK)), BLOCK)
                               for i in range(3)])
    assert results == [tier.enabled] * 3
    assert holds_blocks(backing) is tier.enabled


def test_a_backing_tier_finds_prefixes_and_idents(backing) -> None:
    tier = backing.tier
    for i in range(3):
        backing.put(i)
    keys = [key_of(i)[0] for i in (0, 1, 99, 2)]
    found = tier.lookup_prefix(iter(keys))
    assert [e.key for e in found] == (keys[:2] if tier.enabled else [])
    key, ident = key_of(0)
    assert tier.contains(key, ident) is tier.enabled
    assert tier.contains(key, b"another ident") is False


def test_a_backing_tier_removes_only_unpinned_entries_and_reports_the_drop(backing) -> None:
    tier = backing.tier
    entry = backing.put(5)
    if entry is None:
        assert not tier.enabled and backing.dropped == []
        return
    key, _ = key_of(5)
    assert backing.read(entry) == block_bytes(5, BLOCK)
    assert tier.pin_many([entry]) == 1
    assert tier.remove(entry) is False
    tier.unpin(entry)
    assert tier.remove(entry) is True
    assert tier.remove(entry) is False  # already gone
    assert tier.lookup(key) is None and backing.dropped == [key]
    tier.check_integrity()
