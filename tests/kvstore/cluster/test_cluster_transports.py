"""Which UCX transports reach a peer: ``ucp_ep_query`` on real endpoints between ClusterNodes on
loopback (UCX picks tcp here, plus shared memory with UCX_MM_ERROR_HANDLING=y), in the node's
stats and its log once per peer; a UCX that cannot tell is "unknown", counted, and fetches go
on."""

from __future__ import annotations

import logging

import pytest
from cluster_parts import make_blocks, shm_lanes

from kvstore.cluster.ucx import transports
from kvstore.cluster.ucx.transports import data_transports, endpoint_transports, loaded_libucp

pytestmark = pytest.mark.cluster


def test_a_peer_over_loopback_is_reached_by_tcp(make_node, caplog):
    a, store_a = make_node("a")
    b, _ = make_node("b")
    blocks = make_blocks(6)
    blocks.put_all(store_a, a)
    assert "/libucp.so" in (loaded_libucp() or "")  # ucxx's own copy, found in the maps

    with caplog.at_level(logging.INFO, logger="kvstore.cluster.node"):
        assert b.fetch_remote_prefix(blocks.namespace, blocks.hashes, blocks.idents) == 6
        b.client.close()  # the next fetch connects again: same lanes, not logged again
        b.client.start()
        for h in blocks.hashes:
            b.store.remove(blocks.namespace, h)
        assert b.fetch_remote_prefix(blocks.namespace, blocks.hashes, blocks.idents) == 6

    peer = b.stats()["peers"]["a"]
    assert peer["addr"] == a.addr
    # One lane is the sockaddr handshake's connection manager (tcp); the data lanes are tcp
    # over this host's network devices, loopback among them (UCX_NET_DEVICES is not set here).
    assert "cm:tcp" in peer["lanes"]
    tcp = {t for t in peer["transports"] if t.startswith("tcp/")}
    assert "tcp/lo" in tcp and set(peer["transports"]) == tcp | shm_lanes()
    assert peer["transports"] == data_transports(peer["lanes"])
    assert b.stats()["client"].get("transports_unknown", 0) == 0
    logged = [r.getMessage() for r in caplog.records if "UCX to peer a " in r.getMessage()]
    assert len(logged) == 1 and "tcp/lo" in logged[0], logged
    assert a.stats()["peers"] == {}  # a fetched from nobody


def test_a_ucx_that_cannot_tell_is_unknown_and_counted(make_node, monkeypatch):
    # As with a UCX older than 1.14 (no UCP_EP_ATTR_FIELD_TRANSPORTS): the query is refused.
    monkeypatch.setattr(transports, "_MIN_VERSION", (99, 0))
    transports._ep_query.cache_clear()
    try:
        a, store_a = make_node("a")
        b, _ = make_node("b")
        blocks = make_blocks(3)
        blocks.put_all(store_a, a)
        assert b.fetch_remote_prefix(blocks.namespace, blocks.hashes, blocks.idents) == 3
        stats = b.stats()
        assert stats["peers"]["a"]["transports"] == ["unknown"]
        assert stats["peers"]["a"]["lanes"] == []
        assert stats["client"]["transports_unknown"] == 1
    finally:
        transports._ep_query.cache_clear()


def test_anything_but_an_open_ucxx_endpoint_is_unknown():
    class Closed:
        @property
        def ucp_endpoint(self) -> int:
            raise AttributeError("'NoneType' object has no attribute 'handle'")  # as ucxx's

    assert endpoint_transports(object()) is None
    assert endpoint_transports(Closed()) is None
    assert data_transports(None) == []
    assert data_transports(["cm:tcp", "tcp/lo", "tcp/lo", "sysv/memory"]) == [
        "sysv/memory", "tcp/lo"]
