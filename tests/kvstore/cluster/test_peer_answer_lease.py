"""A peer's fetch is answered from DRAM views under a lease being read until the answer closes:
however long UCX takes to send the payloads, the lease neither expires nor lets its blocks go
meanwhile (a full pool refuses a write rather than reuse them), and its pins go, counted, at
``close``. No UCX here: the answer as the server's worker thread builds it (``read_blocks``)."""

from __future__ import annotations

import time

import pytest

from kvstore.cluster.peers.server import PeerServer
from kvstore.store.block_store import StoreError
from kvstore.store.tiered import StoreConfig, TieredStore

BLOCK = 4096
NS = bytes(range(16))


def _key(i: int) -> tuple[bytes, bytes]:
    return i.to_bytes(16, "little"), b"ident-%d" % i


def _bytes(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK


def test_a_peer_answer_holds_its_blocks_until_it_closes() -> None:
    store = TieredStore(StoreConfig(dram_bytes=4 * BLOCK, pin_memory=False))
    try:
        for i in range(4):
            h, ident = _key(i)
            assert store.put(NS, h, ident, _bytes(i))
        hashes, idents = zip(*(_key(i) for i in range(4)), strict=True)
        server = PeerServer(store, "127.0.0.1", 0)  # never started: no listener, no UCX
        answer = server.read_blocks(NS, list(hashes), list(idents), timeout_s=0.01)
        assert len(answer.views) == len(answer.entries) == 4
        # Past the lease's deadline (timeout + slack) while the payloads are still going out:
        assert store.expire_leases(now=time.monotonic() + 60) == 0
        h, ident = _key(50)
        with pytest.raises(StoreError):  # every block pinned: none may be evicted for a write
            store.begin_write(NS, h, ident, BLOCK)
        assert [bytes(v) for v in answer.views] == [_bytes(i) for i in range(4)]
        answer.close()
        answer.close()  # idempotent
        assert store.stats()["leases"] == 0
        assert store.stats()["tiers"]["dram"]["pinned_blocks"] == 0
        assert store.put(NS, h, ident, _bytes(50))  # room is made again
        store.check_integrity()
    finally:
        store.close()


def test_a_miss_answers_nothing_and_holds_nothing() -> None:
    store = TieredStore(StoreConfig(dram_bytes=4 * BLOCK, pin_memory=False))
    try:
        server = PeerServer(store, "127.0.0.1", 0)
        h, ident = _key(7)
        answer = server.read_blocks(NS, [h], [ident], timeout_s=1.0)
        assert answer.lease is None and answer.views == [] and answer.entries == []
        answer.close()
        assert store.stats()["leases"] == 0
    finally:
        store.close()
