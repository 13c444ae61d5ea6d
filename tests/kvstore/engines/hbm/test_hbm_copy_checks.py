"""The HBM tier's seqlock check, in process: a generation that moves while a block is being copied.

The daemon's copy path is driven directly (a real store, registry and shared-memory arenas) so
the owner's reallocation can land exactly between a block's copy and its second generation
check: that block must fail and the count stop before it, whatever bytes it copied. The same
holds where blocks are staged from an arena into the store for a peer node: a block whose
generation moved is never committed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from daemon_helpers import make_chain
from support.arena import ShmArena

from kvstore.engines.hbm.tier import HbmTier
from kvstore.engines.registry import Registry
from kvstore.store.tiered import StoreConfig, TieredStore

NUM_BLOCKS = 16
BLOCK_BYTES = 32 * 1024


def _arena(seed: int | None, num_blocks: int = NUM_BLOCKS, split_kv: bool = False) -> ShmArena:
    """An engine's arena that shares its block generations (the HBM tier reads them)."""
    return ShmArena(num_blocks, BLOCK_BYTES, seed, split_kv=split_kv, generations=True)


@pytest.fixture
def parts() -> Iterator[tuple[TieredStore, Registry, HbmTier, list[ShmArena]]]:
    store = TieredStore(StoreConfig(dram_bytes=1 << 20, pin_memory=False))
    registry = Registry()
    tier = HbmTier(store, registry)
    arenas: list[ShmArena] = []
    yield store, registry, tier, arenas
    registry.close_all()
    store.close()
    for arena in arenas:
        arena.close()


def _setup(parts, num_blocks: int):
    store, registry, tier, arenas = parts
    owner_arena, reader_arena = _arena(11), _arena(None)
    arenas += [owner_arena, reader_arena]
    owner = registry.register(owner_arena.layout.to_wire(), "owner", "conn-owner",
                              owner_arena.layout.fds)
    reader = registry.register(reader_arena.layout.to_wire(), "reader", "conn-reader",
                               reader_arena.layout.fds)
    chain = make_chain("hbm-seqlock", num_blocks, seed=12)
    ids = list(range(num_blocks))
    assert tier.publish(owner, chain.namespace, ids, chain.hashes, chain.idents,
                        owner_arena.allocate(ids)) == chain.hashes
    hit = tier.lookup(chain.namespace, chain.hashes, chain.idents, "conn-reader", 30.0)
    assert hit is not None and hit.num_hit == num_blocks and hit.lease is None
    return owner, reader, owner_arena, reader_arena, chain, hit


def _no_store(lease, first_index: int, block_ids) -> int:
    raise AssertionError("every block of these hits is in the HBM tier")


class _NotCancelled:
    cancelled = False

    def check(self) -> None:
        pass


def _store_path(store: TieredStore, reader):
    """The daemon's store path for ``reader``: a lease's blocks copied into its arena."""
    def load_lease(lease, first_index: int, block_ids) -> int:
        with store.reading(lease):
            return reader.load_blocks(store, lease, first_index, list(block_ids),
                                      _NotCancelled())
    return load_lease


def test_reallocation_during_a_copy_fails_that_block(parts) -> None:
    _, _, tier, _ = parts
    owner, reader, owner_arena, reader_arena, chain, hit = _setup(parts, 5)

    def owner_reallocates(i: int) -> None:
        if i == 2:  # block 2's bytes were copied; the owner reallocates and overwrites it now
            owner_arena.allocate([2])
            owner_arena.array[2 * BLOCK_BYTES:3 * BLOCK_BYTES] = 0

    with reader.open_for_copy():
        num = tier.load(hit, reader, [8, 9, 10, 11, 12], _no_store, lambda: False,
                        owner_reallocates)
    assert num == 2
    assert [reader_arena.block(8 + i) == owner_arena.block(i) for i in range(2)] == [True, True]
    counters = tier.stats()["counters"]
    assert counters["generation_failures"] == 1 and counters["blocks_copied"] == 2
    assert counters["index_dropped_stale"] == 1  # the entry went with it
    again = tier.lookup(chain.namespace, chain.hashes, chain.idents, "conn-reader", None)
    assert again.num_hit == 2


def test_a_block_reused_mid_run_comes_from_the_store_where_it_is_saved_too(parts) -> None:
    """Write-through: the owner published its blocks and saved them. It reuses block 2 while a
    reader copies the run: blocks 2-4 come from the store instead, under a lease of their own
    (released after), and the whole hit lands byte-exact."""
    store, _, tier, _ = parts
    owner, reader, owner_arena, reader_arena, chain, hit = _setup(parts, 5)
    assert _stage(tier, chain) == 5  # the store holds the five blocks too
    expected = [owner_arena.block(i) for i in range(5)]

    def owner_reallocates(i: int) -> None:
        if i == 2:
            owner_arena.allocate([2])
            owner_arena.array[2 * BLOCK_BYTES:3 * BLOCK_BYTES] = 0

    with reader.open_for_copy():
        num = tier.load(hit, reader, [8, 9, 10, 11, 12], _store_path(store, reader),
                        lambda: False, owner_reallocates)
    assert num == 5
    assert [reader_arena.block(8 + i) for i in range(5)] == expected
    counters = tier.stats()["counters"]
    assert counters["generation_failures"] == 1 and counters["blocks_copied"] == 2
    assert counters["store_fallbacks"] == 1 and counters["blocks_from_store_instead"] == 3
    assert store.stats()["leases"] == 0  # the fallback's lease was released
    store.check_integrity()


def test_a_block_reused_mid_run_and_not_in_the_store_ends_the_count(parts) -> None:
    store, _, tier, _ = parts
    owner, reader, owner_arena, reader_arena, chain, hit = _setup(parts, 5)
    assert _stage(tier, chain, start=3) == 2  # the store holds blocks 3-4, not 2

    def owner_reallocates(i: int) -> None:
        if i == 2:
            owner_arena.allocate([2])

    with reader.open_for_copy():
        num = tier.load(hit, reader, [8, 9, 10, 11, 12], _store_path(store, reader),
                        lambda: False, owner_reallocates)
    assert num == 2  # fail closed: the chain breaks at block 2
    counters = tier.stats()["counters"]
    assert counters["store_fallbacks"] == 0 and counters["blocks_from_store_instead"] == 0
    assert counters["store_fallbacks_missed"] == 1
    assert store.stats()["leases"] == 0


def test_owner_gone_during_a_copy_fails_the_rest(parts) -> None:
    _, registry, tier, _ = parts
    owner, reader, owner_arena, reader_arena, chain, hit = _setup(parts, 4)

    def owner_disconnects(i: int) -> None:
        if i == 1:
            registry.drop_owner("conn-owner")

    with reader.open_for_copy():
        num = tier.load(hit, reader, [4, 5, 6, 7], _no_store, lambda: False, owner_disconnects)
    assert num == 1
    assert tier.stats()["counters"]["owner_closed_failures"] == 1
    assert tier.stats()["blocks"] == 0
    assert tier.lookup(chain.namespace, chain.hashes, chain.idents, "conn-reader", None) is None


def test_a_stopped_copy_counts_only_what_it_finished(parts) -> None:
    _, _, tier, _ = parts
    owner, reader, owner_arena, reader_arena, chain, hit = _setup(parts, 4)
    calls = iter([False, False, True])
    with reader.open_for_copy():
        num = tier.load(hit, reader, [0, 1, 2, 3], _no_store, lambda: next(calls, True))
    assert num == 2
    assert tier.stats()["counters"]["copies_stopped"] == 1


def _stage(tier: HbmTier, chain, start: int = 0, after_copy=None) -> int:
    return tier.stage(chain.namespace, chain.hashes, chain.idents, start,
                      time.monotonic() + 10.0, after_copy)


def _hashes_left(tier: HbmTier) -> list[bytes]:
    """The hashes ``tier`` reports as gone from its index from now on, as they come."""
    left: list[bytes] = []
    tier.add_left_listener(lambda namespace, hashes: left.extend(hashes))
    return left


def test_staging_stores_the_arenas_blocks_byte_exact(parts) -> None:
    store, _, tier, _ = parts
    owner, reader, owner_arena, reader_arena, chain, hit = _setup(parts, 6)
    assert _stage(tier, chain, start=2) == 4
    got = [store.get(chain.namespace, h, i) for h, i in zip(chain.hashes, chain.idents)]
    assert got[:2] == [None, None]
    assert got[2:] == [owner_arena.block(b) for b in range(2, 6)]
    assert _stage(tier, chain) == 6  # the last four are stored already: staged once
    counters = tier.stats()["counters"]
    assert counters["blocks_staged"] == 6 and counters["stages"] == 2
    store.check_integrity()


def test_reallocation_during_staging_commits_nothing_of_that_block(parts) -> None:
    store, _, tier, _ = parts
    owner, reader, owner_arena, reader_arena, chain, hit = _setup(parts, 5)
    left = _hashes_left(tier)

    def owner_reallocates(i: int) -> None:
        if i == 2:  # block 2's bytes are in the store's slot; the owner reallocates it now
            owner_arena.allocate([2])

    assert _stage(tier, chain, after_copy=owner_reallocates) == 2
    held = store.holding(chain.namespace, chain.hashes)
    assert held == [True, True, False, False, False]
    assert tier.stats()["counters"]["stage_generation_failures"] == 1
    assert left == [chain.hashes[2]]  # its entry was dropped: the cluster may withdraw it
    store.check_integrity()


def test_staging_from_a_closed_owner_stores_nothing(parts) -> None:
    store, registry, tier, _ = parts
    owner, reader, owner_arena, reader_arena, chain, hit = _setup(parts, 3)
    left = _hashes_left(tier)
    registry.drop_owner("conn-owner")
    assert sorted(left) == sorted(chain.hashes)
    assert _stage(tier, chain) == 0
    assert store.holding(chain.namespace, chain.hashes) == [False] * 3
