"""TieredStore's drop listeners: the cluster hears of a block exactly when no tier holds it.

Real stores (DRAM, and DRAM + SSD files), no Redis or UCX: not marked `cluster`.
"""

from __future__ import annotations

import threading

from cluster_parts import make_blocks, wait_until

from kvstore.store.block_store import Tier
from kvstore.store.tiered import StoreConfig, TieredStore

BLOCK = 64 << 10


class Drops:
    """Records what the listener is told; checks that it is never called under the store's lock."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.calls: list[tuple[bytes, list[bytes]]] = []
        self._lock = threading.Lock()

    def __call__(self, namespace: bytes, hashes: list[bytes]) -> None:
        assert self.store._lock.acquire(blocking=False), "called with the store's lock held"
        self.store._lock.release()
        with self._lock:
            self.calls.append((namespace, list(hashes)))

    def hashes(self) -> set[bytes]:
        with self._lock:
            return {h for _, hashes in self.calls for h in hashes}


def _held(store: TieredStore, blocks, i: int) -> bool:
    return store.lookup(blocks.namespace, [blocks.hashes[i]], [blocks.idents[i]],
                        lease_ttl_s=None).num_hit == 1


def test_dram_only_evictions_and_removes_are_reported(tmp_path):
    store = TieredStore(StoreConfig(dram_bytes=8 * BLOCK))
    drops = Drops(store)
    store.add_drop_listener(drops)
    blocks = make_blocks(14, block_bytes=BLOCK)
    try:
        blocks.put_all(store, count=8)
        assert drops.calls == []
        # A lease pins blocks 0..1 (lazily): eviction passes them by, and they are not reported.
        lease = store.lookup(blocks.namespace, blocks.hashes[:2], blocks.idents[:2]).lease
        for i in range(8, 12):
            store.put(blocks.namespace, blocks.hashes[i], blocks.idents[i], blocks.payloads[i])
        assert drops.hashes() == set(blocks.hashes[2:6])  # the LRU unpinned ones
        assert all(ns == blocks.namespace for ns, _ in drops.calls)
        assert all(_held(store, blocks, i) for i in (0, 1, *range(6, 12)))
        lease.release()

        # A duplicate put drops nothing; a remove is reported once, a remove of nothing never.
        store.put(blocks.namespace, blocks.hashes[9], blocks.idents[9], blocks.payloads[9])
        assert store.remove(blocks.namespace, blocks.hashes[9])
        assert not store.remove(blocks.namespace, blocks.hashes[13])
        assert drops.hashes() == set(blocks.hashes[2:6]) | {blocks.hashes[9]}
        store.check_integrity()
    finally:
        store.close()


def test_demotion_is_no_drop_but_ssd_eviction_and_damage_are(tmp_path):
    store = TieredStore(StoreConfig(dram_bytes=8 * BLOCK, ssd_dir=tmp_path / "ssd",
                                    ssd_bytes=16 * BLOCK))
    drops = Drops(store)
    store.add_drop_listener(drops)
    blocks = make_blocks(40, block_bytes=BLOCK)
    try:
        blocks.put_all(store)
        # Every DRAM block to SSD too (the SSD has room for them): from then on the demotion
        # thread only lets go of DRAM copies and the SSD evicts nothing more.
        store.flush_to_ssd()
        n = len(blocks.hashes)

        def gone() -> set[bytes]:
            return {blocks.hashes[i] for i in range(n) if not _held(store, blocks, i)}

        # Blocks demoted to SSD stay held and unreported; those the SSD evicted for room (and
        # that DRAM no longer has) are reported: exactly the blocks no tier holds.
        assert wait_until(lambda: drops.hashes() == gone(), 5.0), (len(drops.hashes()),
                                                                    len(gone()))
        assert 0 < len(gone()) < n
        assert store.stats()["tiers"]["ssd"]["counters"]["evictions"] > 0

        # A block only on SSD whose bytes are damaged is dropped at its read: reported.
        on_ssd = [i for i in range(n) if _held(store, blocks, i) and store.lookup(
            blocks.namespace, [blocks.hashes[i]], [blocks.idents[i]],
            lease_ttl_s=None).tiers == [Tier.SSD]]
        assert len(on_ssd) >= 2
        damaged, removed = on_ssd[0], on_ssd[1]
        path, offset, _ = store.ssd_tier.locate(blocks.namespace + blocks.hashes[damaged])
        with open(path, "r+b") as f:
            f.seek(offset + 100)
            byte = f.read(1)
            f.seek(offset + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        assert store.get(blocks.namespace, blocks.hashes[damaged], blocks.idents[damaged]) is None
        assert blocks.hashes[damaged] in drops.hashes()

        assert store.remove(blocks.namespace, blocks.hashes[removed])  # only on SSD
        assert blocks.hashes[removed] in drops.hashes()
        assert drops.hashes() == gone()
        store.check_integrity()
    finally:
        store.close()
