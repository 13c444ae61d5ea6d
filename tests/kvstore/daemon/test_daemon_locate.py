"""``locate`` through a real daemon: where a chain's leading blocks are, per registered engine (the
HBM tier's index) and in the store's tiers, in one call that leaves no trace.

Two connections play two engines with shared-memory arenas that publish their resident blocks; a
third, with no registration, plays the router that asks. A probe takes no lease, counts no hit,
promotes nothing and leaves the eviction order as it was.
"""

from __future__ import annotations

import pytest
from daemon_helpers import RunningDaemon, make_chain
from support.arena import ShmArena

from kvstore.wire.client import Client, ClientError
from kvstore.wire.verbs import MAX_LOCATE_BLOCKS

pytestmark = pytest.mark.timeout(90)

NUM_BLOCKS = 16
BLOCK_BYTES = 32 * 1024


def _arena(arenas: list[ShmArena], seed: int | None) -> ShmArena:
    arena = ShmArena(NUM_BLOCKS, BLOCK_BYTES, seed, generations=True)
    arenas.append(arena)
    return arena


def _publish(c: Client, reg: int, arena: ShmArena, chain, block_ids: list[int]) -> int:
    gens = arena.allocate(block_ids)
    n = len(block_ids)
    return c.resident(reg, chain.namespace, block_ids, chain.hashes[:n], chain.idents[:n], gens)


def _held(reply, reg: int) -> int:
    (engine,) = [e for e in reply.engines if e.registration_id == reg]
    return engine.num_hbm


def _trace(c: Client) -> dict:
    """Everything a lookup would change: hits, lookups, leases, the HBM tier's counters."""
    stats = c.stats()
    counters = stats["counters"]
    hbm = stats["tiers"]["hbm"]
    return {"lookups": counters["lookups"], "dram_hits": counters["hit_blocks_dram"],
            "ssd_hits": counters["hit_blocks_ssd"], "misses": counters["miss_blocks"],
            "promotions": counters["promotions"], "leases": stats["daemon"]["leases_active"],
            "hbm_hits": hbm["hits"], "hbm_lookups": hbm["counters"]["lookups"],
            "hbm_blocks": hbm["blocks"]}


def test_per_engine_hbm_prefixes_and_the_store_in_one_call(daemon: RunningDaemon,
                                                          arenas: list[ShmArena]) -> None:
    arena_a, arena_b = _arena(arenas, 1), _arena(arenas, 2)
    chain = make_chain("locate-engines", 8, seed=11)
    with daemon.client() as a, daemon.client() as b, daemon.client() as router:
        reg_a, reg_b = a.register(arena_a.layout, "engine-a"), b.register(arena_b.layout,
                                                                          "engine-b")
        assert _publish(a, reg_a, arena_a, chain, [5, 3, 9, 0, 1, 2]) == 6
        assert _publish(b, reg_b, arena_b, chain, [7, 8, 4]) == 3
        assert a.save(reg_a, chain.namespace, [5, 3, 9, 0], chain.hashes[:4],
                      chain.idents[:4]).num_saved == 4
        before = _trace(router)
        reply = router.locate(chain.namespace, chain.hashes, chain.idents)
        assert reply.num_blocks == 8
        assert _held(reply, reg_a) == 6 and _held(reply, reg_b) == 3
        assert {e.engine_id for e in reply.engines if e.registration_id in (reg_a, reg_b)} == \
            {"engine-a", "engine-b"}
        assert all(e.device == "cpu" for e in reply.engines)
        assert reply.store_tiers == ["dram"] * 4 and reply.num_stored == reply.num_dram == 4
        assert _trace(router) == before  # no lease, no hit, no lookup counted
        # The list form answers the same as the packed one the client sends.
        listed = router.call("locate", {"namespace": chain.namespace, "hashes": chain.hashes,
                                        "idents": chain.idents})
        assert listed["tier_runs"] == [["dram", 4]]
        assert {e["registration_id"]: e["num_hbm"] for e in listed["engines"]}[reg_a] == 6

        # Verified as a lookup is: a wrong ident ends every prefix there.
        idents = list(chain.idents)
        idents[2] = idents[2][:-1] + bytes([idents[2][-1] ^ 1])
        reply = router.locate(chain.namespace, chain.hashes, idents)
        assert _held(reply, reg_a) == 2 and _held(reply, reg_b) == 2 and reply.num_stored == 2
        # A block the engine reallocated since publishing ends its run at that block.
        arena_a.allocate([1])
        reply = router.locate(chain.namespace, chain.hashes, chain.idents)
        assert _held(reply, reg_a) == 4 and _held(reply, reg_b) == 3
        # Another tenant's namespace holds nothing of it.
        other = make_chain("locate-engines-other", 8, seed=11)
        reply = router.locate(other.namespace, chain.hashes, chain.idents)
        assert _held(reply, reg_a) == 0 and reply.num_stored == 0
        # An engine that leaves is no longer listed.
        assert b.unregister(reg_b)
        reply = router.locate(chain.namespace, chain.hashes, chain.idents)
        assert reg_b not in {e.registration_id for e in reply.engines}
        assert router.stats()["daemon"]["leases_active"] == 0


def test_a_probe_does_not_change_the_eviction_order(make_daemon, arenas: list[ShmArena]) -> None:
    daemon = make_daemon(dram="256KiB", http=False)  # exactly 8 blocks: no room to spare
    arena = _arena(arenas, 3)
    chains = {name: make_chain(f"locate-lru-{name}", 4, seed=i)
              for i, name in enumerate("xyzw")}
    with daemon.client() as engine, daemon.client() as router:
        reg = engine.register(arena.layout, "engine")

        def save(name: str, block_ids: list[int]) -> None:
            chain = chains[name]
            assert engine.save(reg, chain.namespace, block_ids, chain.hashes,
                               chain.idents).num_saved == 4

        def stored(name: str) -> int:
            chain = chains[name]
            return router.locate(chain.namespace, chain.hashes, chain.idents).num_stored

        save("x", [0, 1, 2, 3])
        save("y", [4, 5, 6, 7])
        for _ in range(5):  # probes of the oldest blocks: not uses of them
            assert stored("x") == 4
        save("z", [8, 9, 10, 11])
        assert (stored("x"), stored("y"), stored("z")) == (0, 4, 4)
        # A lookup, unlike a probe, is a use: y outlives z now.
        chain = chains["y"]
        assert router.lookup(chain.namespace, chain.hashes, chain.idents,
                             lease_ttl_s=0).num_hit == 4
        save("w", [12, 13, 14, 15])
        assert (stored("y"), stored("z"), stored("w")) == (4, 0, 4)


def test_ssd_blocks_are_located_without_a_promotion(make_daemon, tmp_path,
                                                    arenas: list[ShmArena]) -> None:
    daemon = make_daemon(dram="256KiB", ssd_dir=tmp_path / "ssd", ssd_size="4MiB", http=False)
    arena = _arena(arenas, 4)
    chain = make_chain("locate-ssd", 12, seed=5)
    with daemon.client() as engine, daemon.client() as router:
        reg = engine.register(arena.layout, "engine")
        assert engine.save(reg, chain.namespace, list(range(12)), chain.hashes,
                           chain.idents).num_saved == 12
        before = _trace(router)
        reply = router.locate(chain.namespace, chain.hashes, chain.idents)
        assert reply.num_stored == 12 and "ssd" in reply.store_tiers
        assert reply.num_dram == reply.store_tiers.index("ssd")
        assert _trace(router) == before  # nothing promoted, nothing counted


def test_bad_locates_are_refused(daemon: RunningDaemon) -> None:
    chain = make_chain("locate-bad", 2, seed=6)
    with daemon.client() as c:
        too_long = [chain.hashes[0]] * (MAX_LOCATE_BLOCKS + 1)
        with pytest.raises(ClientError) as info:
            c.locate(chain.namespace, too_long, [chain.idents[0]] * len(too_long))
        assert info.value.code == "bad_request" and "at most" in info.value.message
        with pytest.raises(ClientError) as info:
            c.call("locate", {"namespace": chain.namespace, "hashes": chain.hashes,
                              "idents": chain.idents[:1]})
        assert info.value.code == "bad_request"
        with pytest.raises(ClientError) as info:
            c.call("locate", {"namespace": chain.namespace, "hashes": chain.hashes,
                              "idents": chain.idents, "lease_ttl_s": 5})
        assert info.value.code == "bad_request"
        assert c.locate(chain.namespace, [], []).num_blocks == 0
        assert c.health()["status"] == "ok"


def test_engines_lists_registrations_with_the_identity_each_declared(
        daemon: RunningDaemon, arenas: list[ShmArena]) -> None:
    """A router in front of vLLM keys the connector's blocks by the identity its workers
    declare in their layout's meta: ``engines`` hands it on, as plain data."""
    from dataclasses import replace

    identity = {"architecture": "vllm:Qwen3ForCausalLM|cpu:x", "num_layers": 2,
                "num_kv_heads": 2, "head_dim": 32, "kv_dtype": "bfloat16", "block_size": 16,
                "weights_id": "dir:abc", "kv_layout_version": 1}
    declared = replace(_arena(arenas, 1).layout, meta={"model_identity": identity,
                                                        "num_shards": 2})
    with daemon.client() as a, daemon.client() as b, daemon.client() as router:
        assert router.engines() == []
        reg_a = a.register(declared, "vllm-a")
        reg_b = b.register(_arena(arenas, 2).layout, "engine-b")
        engines = {e["engine_id"]: e for e in router.engines()}
        assert engines["vllm-a"]["registration_id"] == reg_a
        assert engines["vllm-a"]["model_identity"] == identity
        assert engines["vllm-a"]["num_shards"] == 2
        assert engines["engine-b"]["registration_id"] == reg_b
        assert engines["engine-b"]["model_identity"] is None
        assert engines["engine-b"]["num_shards"] == 1
        with pytest.raises(ClientError, match="unknown args"):
            router.call("engines", {"extra": 1})
