"""Failure paths: peers that lie, stall or are gone, and a Redis that dies or freezes."""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
import pytest
from cluster_parts import FAST, free_port, make_blocks, wait_until

from kvstore.cluster.config import ClusterConfig
from kvstore.cluster.index import ClusterIndex
from kvstore.cluster.peers.transport import (
    PROTOCOL_VERSION,
    TAG_PAYLOAD,
    TAG_REQ,
    TAG_REQ_LEN,
    TAG_RESP,
    TAG_RESP_LEN,
    checksum,
    recv_frame,
    send_frame,
)
from kvstore.cluster.ucx.runtime import UcxRuntime

pytestmark = pytest.mark.cluster


class FakePeer:
    """A peer that speaks the fetch protocol but misbehaves, registered in Redis like a node.

    ``mode``: "flip" sends block ``bad_index`` with one bit flipped (the checksum announced is
    the true one), "wrong_ident" announces another ident for it, "silent" never answers, "stall"
    announces every block but stops sending before block ``bad_index``.
    """

    def __init__(self, redis_url: str, node_id: str, blocks, mode: str, bad_index: int = 0):
        self.blocks, self.mode, self.bad_index = blocks, mode, bad_index
        self._runtime = UcxRuntime.acquire()
        self._handlers: set[asyncio.Task] = set()
        self._endpoints: set = set()
        self.port = self._runtime.call(self._listen(), 10.0)
        config = ClusterConfig(redis_url=redis_url, node_id=node_id, **FAST)
        self.index = ClusterIndex(config, f"127.0.0.1:{self.port}")
        assert self.index.start(2.0)
        self.index.publish(blocks.namespace, blocks.hashes)
        assert self.index.flush(2.0)

    async def _listen(self) -> int:
        import ucxx

        self._listener = ucxx.create_listener(self._handle, port=0)
        return self._listener.port

    async def _handle(self, ep) -> None:
        self._handlers.add(asyncio.current_task())
        self._endpoints.add(ep)
        try:
            while True:
                request = await recv_frame(ep, TAG_REQ_LEN, TAG_REQ)
                if self.mode == "silent":
                    await asyncio.sleep(60)
                n = len(request["hashes"])
                entries, payloads = [], []
                for i in range(n):
                    data = np.frombuffer(self.blocks.payloads[i], dtype=np.uint8).copy()
                    entries.append([self.blocks.hashes[i], self.blocks.idents[i], data.nbytes,
                                    checksum(data)])
                    payloads.append(data)
                if self.mode == "flip":
                    payloads[self.bad_index][100] ^= 0x10
                elif self.mode == "wrong_ident":
                    entries[self.bad_index][1] = b"forged" + entries[self.bad_index][1]
                await send_frame(ep, TAG_RESP_LEN, TAG_RESP,
                                 {"v": PROTOCOL_VERSION, "blocks": entries, "error": None})
                for i, data in enumerate(payloads):
                    if self.mode == "stall" and i == self.bad_index:
                        await asyncio.sleep(60)
                    await ep.send(data, tag=TAG_PAYLOAD + i)
        except (Exception, asyncio.CancelledError):
            pass
        finally:
            self._endpoints.discard(ep)
            self._handlers.discard(asyncio.current_task())

    def close(self) -> None:
        self.index.stop()

        async def shutdown() -> None:
            for ep in list(self._endpoints):
                with contextlib.suppress(Exception):
                    ep.abort(period=100_000_000)
            for task in list(self._handlers):
                task.cancel()
            if self._handlers:
                await asyncio.wait(list(self._handlers), timeout=2.0)
            self._listener.close()

        self._runtime.call(shutdown(), 5.0)
        self._runtime.release()


@pytest.fixture
def fake_peer(redis_server, ucx_runtime):
    made: list[FakePeer] = []

    def make(node_id: str, blocks, mode: str, bad_index: int = 0) -> FakePeer:
        peer = FakePeer(redis_server.url, node_id, blocks, mode, bad_index)
        made.append(peer)
        return peer

    yield make
    for peer in made:
        peer.close()


def _sees(node, node_id: str) -> bool:
    return node_id in node.index.live_nodes()


@pytest.mark.parametrize("mode", ["flip", "wrong_ident"])
def test_lying_peer_is_a_miss_never_wrong_bytes(make_node, fake_peer, mode):
    b, store_b = make_node("b")
    blocks = make_blocks(6)
    fake_peer("liar", blocks, mode, bad_index=3)
    assert wait_until(lambda: _sees(b, "liar"), 2.0)
    ns, hashes, idents = blocks.namespace, blocks.hashes, blocks.idents

    assert b.fetch_remote_prefix(ns, hashes, idents) == 3  # the blocks before the lie
    for i in range(3):
        assert store_b.get(ns, hashes[i], idents[i]) == blocks.payloads[i]
    assert store_b.lookup(ns, hashes, idents, lease_ttl_s=None).num_hit == 3
    stats = b.stats()
    assert stats["remote_errors_bad_block"] == 1
    assert stats["client"]["errors_bad_block"] == 1
    # The liar is now skipped: asking again costs no transfer and stores nothing wrong.
    received = stats["client"]["blocks_received"]
    assert b.fetch_remote_prefix(ns, hashes, idents, start_index=3) == 0
    assert b.stats()["client"]["blocks_received"] == received


def test_silent_peer_times_out(make_node, fake_peer):
    b, store_b = make_node("b", remote_timeout_s=0.5)
    blocks = make_blocks(4)
    fake_peer("mute", blocks, "silent")
    assert wait_until(lambda: _sees(b, "mute"), 2.0)
    start = time.monotonic()
    assert b.fetch_remote_prefix(blocks.namespace, blocks.hashes, blocks.idents) == 0
    assert time.monotonic() - start < 0.5 + 0.4
    assert b.stats()["remote_errors_timeout"] == 1
    assert store_b.lookup(blocks.namespace, blocks.hashes, blocks.idents,
                          lease_ttl_s=None).num_hit == 0


def test_peer_stalling_mid_answer_leaves_no_reserved_memory(make_node, fake_peer):
    b, store_b = make_node("b", remote_timeout_s=0.5)
    blocks = make_blocks(6)
    fake_peer("slow", blocks, "stall", bad_index=2)
    assert wait_until(lambda: _sees(b, "slow"), 2.0)
    start = time.monotonic()
    # Write slots for all six blocks are reserved and filling when the deadline hits.
    assert b.fetch_remote_prefix(blocks.namespace, blocks.hashes, blocks.idents) == 0
    assert time.monotonic() - start < 0.5 + 0.4
    assert b.stats()["remote_errors_timeout"] == 1
    # Every slot is given back once UCX let go of it: nothing stays reserved or visible.
    assert wait_until(lambda: store_b.stats()["tiers"]["dram"]["used_bytes"] == 0, 2.0)
    store_b.check_integrity()
    assert store_b.lookup(blocks.namespace, blocks.hashes, blocks.idents,
                          lease_ttl_s=None).num_hit == 0
    blocks.put_all(store_b)  # and the same blocks can be written normally
    assert store_b.get(blocks.namespace, blocks.hashes[3], blocks.idents[3]) == blocks.payloads[3]


def test_unreachable_peer_is_an_immediate_miss(make_node, redis_server):
    b, _ = make_node("b")
    blocks = make_blocks(4)
    # A live registration whose address nobody listens on (a daemon whose listener died).
    ghost = ClusterIndex(ClusterConfig(redis_url=redis_server.url, node_id="ghost", **FAST),
                         f"127.0.0.1:{free_port()}")
    assert ghost.start(2.0)
    try:
        ghost.publish(blocks.namespace, blocks.hashes)
        assert ghost.flush(2.0)
        assert wait_until(lambda: _sees(b, "ghost"), 2.0)
        start = time.monotonic()
        assert b.fetch_remote_prefix(blocks.namespace, blocks.hashes, blocks.idents) == 0
        assert time.monotonic() - start < 0.5  # refused at once, not at the 1 s deadline
        assert b.stats()["remote_errors_unreachable"] == 1
        # Suspect now: the next request does not dial it again.
        assert b.fetch_remote_prefix(blocks.namespace, blocks.hashes, blocks.idents) == 0
        assert b.stats()["remote_errors_unreachable"] == 1
        assert b.stats()["remote_skipped_suspect"] >= 1
    finally:
        ghost.stop()


def test_redis_restart_node_rejoins_and_republishes(make_node, redis_server):
    a, store_a = make_node("a")
    b, store_b = make_node("b")
    blocks = make_blocks(10)
    blocks.put_all(store_a, a, count=5)
    ns, hashes, idents = blocks.namespace, blocks.hashes, blocks.idents

    redis_server.stop()
    assert wait_until(lambda: not a.index.up and not b.index.up, 2.0)
    # Local service goes on: hooks return at once, lookups are quick misses, stores work.
    start = time.monotonic()
    for i in range(5, 10):
        store_a.put(ns, hashes[i], idents[i], blocks.payloads[i])
    a.on_stored(ns, hashes[5:10])
    assert b.fetch_remote_prefix(ns, hashes, idents) == 0
    assert time.monotonic() - start < 0.5
    assert store_a.get(ns, hashes[7], idents[7]) == blocks.payloads[7]

    redis_server.start()  # same port, empty: every registration and entry is gone
    assert wait_until(lambda: a.index.up and b.index.up and _sees(b, "a"), 3.0)
    assert a.index.flush(2.0)
    assert a.stats()["index"]["resyncs"] >= 1
    assert b.fetch_remote_prefix(ns, hashes, idents) == 10  # queued + re-published blocks
    assert store_b.get(ns, hashes[9], idents[9]) == blocks.payloads[9]


def test_paused_redis_is_a_bounded_wait(make_node, redis_server):
    a, store_a = make_node("a")
    b, store_b = make_node("b")
    blocks = make_blocks(6)
    blocks.put_all(store_a, a, count=3)
    ns, hashes, idents = blocks.namespace, blocks.hashes, blocks.idents

    redis_server.pause()
    try:
        start = time.monotonic()
        assert b.fetch_remote_prefix(ns, hashes, idents) == 0
        assert time.monotonic() - start < b.config.redis_timeout_s + 0.4
        start = time.monotonic()
        a.on_stored(ns, hashes[3:6])  # queued, never waits on Redis
        for i in range(3, 6):
            store_a.put(ns, hashes[i], idents[i], blocks.payloads[i])
        assert time.monotonic() - start < 0.1
        assert wait_until(lambda: not a.index.up and not b.index.up, 2.0)
        start = time.monotonic()
        assert b.fetch_remote_prefix(ns, hashes, idents) == 0  # index down: no wait at all
        assert time.monotonic() - start < 0.1
    finally:
        redis_server.resume()
    assert wait_until(lambda: a.index.up and b.index.up and _sees(b, "a"), 3.0)
    assert a.index.flush(2.0)
    assert b.fetch_remote_prefix(ns, hashes, idents) == 6
    assert store_b.get(ns, hashes[5], idents[5]) == blocks.payloads[5]
    assert b.stats()["index"]["redis_down_events"] >= 1


def test_node_started_while_redis_is_down_joins_later(make_node, redis_server):
    redis_server.stop()
    start = time.monotonic()
    b, store_b = make_node("b")  # start() does not fail, and waits only briefly
    assert time.monotonic() - start < 2.0
    assert not b.index.up
    blocks = make_blocks(3)
    assert b.fetch_remote_prefix(blocks.namespace, blocks.hashes, blocks.idents) == 0
    redis_server.start()
    a, store_a = make_node("a")
    blocks.put_all(store_a, a)
    assert wait_until(lambda: b.index.up and _sees(b, "a"), 3.0)
    assert b.fetch_remote_prefix(blocks.namespace, blocks.hashes, blocks.idents) == 3
    assert store_b.get(blocks.namespace, blocks.hashes[2], blocks.idents[2]) == blocks.payloads[2]
