"""``lookup_load`` through a real daemon: a lookup whose hit is loaded in the same round trip
when it is all in DRAM (or HBM), and handed back leased when it is not."""

from __future__ import annotations

import pytest
from daemon_helpers import RunningDaemon, make_chain
from support.arena import ShmArena

from kvstore.wire.client import Client, ClientError

pytestmark = pytest.mark.timeout(90)

NUM_BLOCKS = 8
BLOCK_BYTES = 64 * 1024


def _leases(c: Client) -> int:
    return c.stats()["daemon"]["leases_active"]


def _saved(c: Client, src: ShmArena, name: str, num_saved: int):
    """A chain of NUM_BLOCKS whose first ``num_saved`` blocks the store holds (from ``src``)."""
    chain = make_chain(name, NUM_BLOCKS, seed=len(name))
    reg = c.register(src.layout, f"src-{name}")
    out = c.save(reg, chain.namespace, range(num_saved), chain.hashes[:num_saved],
                 chain.idents[:num_saved])
    assert out.outcomes == ["saved"] * num_saved
    c.evicted(chain.namespace, chain.hashes, reg)
    assert c.unregister(reg)
    return chain


def _source_and_target(arenas: list[ShmArena], seed: int) -> tuple[ShmArena, ShmArena]:
    """An arena of random blocks to save from and an empty one to load into (closed after the
    test, with ``arenas``)."""
    src = ShmArena(NUM_BLOCKS, BLOCK_BYTES, seed=seed)
    dst = ShmArena(NUM_BLOCKS, BLOCK_BYTES, seed=None)
    arenas += [src, dst]
    return src, dst


def _saved_for(c: Client, src: ShmArena, dst: ShmArena, name: str, num_saved: int):
    """``_saved``'s chain and the registration of ``dst`` to load it into."""
    return _saved(c, src, name, num_saved), c.register(dst.layout, "dst")


def test_a_dram_hit_is_loaded_in_the_same_round_trip(daemon: RunningDaemon,
                                                     arenas: list[ShmArena]) -> None:
    src, dst = _source_and_target(arenas, seed=3)
    with daemon.client() as c:
        chain, reg = _saved_for(c, src, dst, "whole", NUM_BLOCKS)
        before = _leases(c)
        loaded_before = c.stats()["daemon"]["events"].get("lookup_loads_loaded", 0)
        dst_ids = [7, 6, 5, 4, 3, 2, 1, 0]
        reply = c.lookup_load_async(reg, chain.namespace, chain.hashes, chain.idents,
                                    dst_ids).wait()
        assert (reply.num_hit, reply.num_loaded, reply.lease_id) == (NUM_BLOCKS, NUM_BLOCKS,
                                                                     None)
        assert reply.tiers == ["dram"] * NUM_BLOCKS
        for i in range(NUM_BLOCKS):
            assert dst.block(dst_ids[i]) == src.block(i), f"block {i} differs"
        assert _leases(c) == before  # the load used the lease up
        daemon_stats = c.stats()["daemon"]
        assert daemon_stats["events"]["lookup_loads_loaded"] == loaded_before + 1
        # Its time, split into lookup and load, and the verb's request time.
        assert daemon_stats["events"]["lookup_load_us_load"] > 0
        assert "lookup_load_us_lookup" in daemon_stats["events"]
        timed = daemon_stats["request_ms"]["lookup_load"]
        assert timed["count"] >= 1 and timed["sum_ms"] > 0


def test_a_partial_hit_loads_its_prefix_and_touches_nothing_past_it(
        daemon: RunningDaemon, arenas: list[ShmArena]) -> None:
    src, dst = _source_and_target(arenas, seed=5)
    with daemon.client() as c:
        chain, reg = _saved_for(c, src, dst, "prefix", 5)
        reply = c.lookup_load_async(reg, chain.namespace, chain.hashes, chain.idents,
                                    range(NUM_BLOCKS)).wait()
        assert (reply.num_hit, reply.num_loaded, reply.lease_id) == (5, 5, None)
        assert all(dst.block(i) == src.block(i) for i in range(5))
        assert all(dst.block(i) == bytes(BLOCK_BYTES) for i in range(5, NUM_BLOCKS))
        # A miss: nothing loaded, nothing leased, nothing written.
        other = make_chain("never-saved", NUM_BLOCKS, seed=99)
        miss = c.lookup_load_async(reg, other.namespace, other.hashes, other.idents,
                                   range(NUM_BLOCKS)).wait()
        assert (miss.num_hit, miss.num_loaded, miss.lease_id) == (0, None, None)
        assert all(dst.block(i) == bytes(BLOCK_BYTES) for i in range(5, NUM_BLOCKS))


def test_a_hit_shorter_than_min_blocks_comes_back_leased(daemon: RunningDaemon,
                                                         arenas: list[ShmArena]) -> None:
    src, dst = _source_and_target(arenas, seed=7)
    with daemon.client() as c:
        chain, reg = _saved_for(c, src, dst, "short", 3)
        before = _leases(c)
        reply = c.lookup_load_async(reg, chain.namespace, chain.hashes, chain.idents,
                                    range(NUM_BLOCKS), min_blocks=4).wait()
        assert (reply.num_hit, reply.num_loaded) == (3, None) and reply.lease_id is not None
        assert all(dst.block(i) == bytes(BLOCK_BYTES) for i in range(NUM_BLOCKS))
        assert _leases(c) == before + 1  # the engine's to use or give back
        assert c.load(reg, reply.lease_id, [0, 1, 2]) == 3
        assert dst.block(2) == src.block(2)


def test_an_ssd_hit_comes_back_leased_for_the_engine_to_weigh(make_daemon, tmp_path,
                                                              arenas: list[ShmArena]) -> None:
    src, dst = _source_and_target(arenas, seed=9)
    ssd = dict(ssd_dir=tmp_path / "ssd", ssd_size="16MiB", http=False)
    first = make_daemon(dram="4MiB", **ssd)
    with first.client() as c:
        chain = _saved(c, src, "on-ssd", NUM_BLOCKS)
    assert first.stop() == 0  # a graceful stop leaves the blocks on SSD only
    second = make_daemon(dram="4MiB", **ssd)
    with second.client() as c:
        reg = c.register(dst.layout, "dst")
        reply = c.lookup_load_async(reg, chain.namespace, chain.hashes, chain.idents,
                                    range(NUM_BLOCKS)).wait()
        assert reply.tiers == ["ssd"] * NUM_BLOCKS and reply.num_loaded is None
        assert reply.lease_id is not None
        assert all(dst.block(i) == bytes(BLOCK_BYTES) for i in range(NUM_BLOCKS))
        assert c.load(reg, reply.lease_id, range(NUM_BLOCKS)) == NUM_BLOCKS
    assert all(dst.block(i) == src.block(i) for i in range(NUM_BLOCKS))


def test_bad_block_ids_are_refused_before_anything_is_leased(daemon: RunningDaemon,
                                                             arenas: list[ShmArena]) -> None:
    src, dst = _source_and_target(arenas, seed=11)
    with daemon.client() as c:
        chain, reg = _saved_for(c, src, dst, "refused", NUM_BLOCKS)
        before = _leases(c)
        for block_ids, words in (([0, 1], "2 block ids for 8 hashes"),
                                 ([0, 1, 2, 3, 4, 5, 6, NUM_BLOCKS], "out of range")):
            with pytest.raises(ClientError) as info:
                c.lookup_load_async(reg, chain.namespace, chain.hashes, chain.idents,
                                    block_ids).wait()
            assert info.value.code == "bad_request" and words in info.value.message
        with pytest.raises(ClientError) as info:
            c.lookup_load_async(reg + 1000, chain.namespace, chain.hashes, chain.idents,
                                range(NUM_BLOCKS)).wait()
        assert info.value.code == "not_found"
        assert _leases(c) == before
        assert all(dst.block(i) == bytes(BLOCK_BYTES) for i in range(NUM_BLOCKS))
        # The daemon serves on.
        assert c.lookup(chain.namespace, chain.hashes, chain.idents,
                        lease_ttl_s=0).num_hit == NUM_BLOCKS


def test_malformed_lookup_loads_get_errors_and_the_connection_serves_on(
        daemon: RunningDaemon, arenas: list[ShmArena]) -> None:
    dst = ShmArena(NUM_BLOCKS, BLOCK_BYTES, seed=None)
    arenas.append(dst)
    chain = make_chain("malformed", 2, seed=3)
    with daemon.client() as c:
        reg = c.register(dst.layout, "dst")
        good = {"namespace": chain.namespace, "hashes": chain.hashes, "idents": chain.idents,
                "registration_id": reg, "block_ids": [0, 1]}
        for bad, words in (({k: v for k, v in good.items() if k != "registration_id"},
                            "missing arg 'registration_id'"),
                           ({**good, "block_ids": "0,1"}, "'block_ids' must be"),
                           ({**good, "block_ids": [0, -1]}, "'block_ids' must be"),
                           ({**good, "min_blocks": -2}, "'min_blocks' must be"),
                           ({**good, "lease": 1}, "unknown args")):
            with pytest.raises(ClientError) as info:
                c.request("lookup_load", bad).wait()
            assert info.value.code == "bad_request" and words in info.value.message
        assert c.lookup_load_async(reg, chain.namespace, chain.hashes, chain.idents,
                                   [0, 1]).wait().num_hit == 0
