"""The HBM tier through a real daemon: blocks resident in one engine's arena, copied into another's.

Two connections play two engines, each with a shared-memory arena and block generations (the
owner's counters, as ``offload.block_generations`` makes them). Nothing is saved to DRAM unless a
test says so: every hit here comes from the owner's arena. A generation the owner bumps after
publishing fails exactly that block; a dead owner's blocks leave the index.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import textwrap

import pytest
from daemon_helpers import REPO_ROOT, RunningDaemon, make_chain, wait_until
from support.arena import ShmArena

from kvstore.layout import KVLayout, Region
from kvstore.wire.client import Client, ClientError
from offload.block_generations import BlockGenerations

pytestmark = pytest.mark.timeout(90)


NUM_BLOCKS = 16
BLOCK_BYTES = 32 * 1024


def _arena(seed: int | None, num_blocks: int = NUM_BLOCKS, split_kv: bool = False) -> ShmArena:
    """An engine's arena that shares its block generations (the HBM tier reads them)."""
    return ShmArena(num_blocks, BLOCK_BYTES, seed, split_kv=split_kv, generations=True)


def _publish(c: Client, reg: int, arena: ShmArena, chain, block_ids: list[int],
             first: int = 0) -> int:
    gens = arena.allocate(block_ids)
    span = slice(first, first + len(block_ids))
    return c.resident(reg, chain.namespace, block_ids, chain.hashes[span], chain.idents[span],
                      gens)


def _hbm(c: Client) -> dict:
    return c.stats()["tiers"]["hbm"]


@pytest.mark.parametrize("split_kv", [False, True])
def test_second_engine_copies_resident_blocks(daemon: RunningDaemon, arenas: list[ShmArena],
                                              split_kv: bool) -> None:
    owner_arena, reader_arena = _arena(1, split_kv=split_kv), _arena(None, split_kv=split_kv)
    arenas += [owner_arena, reader_arena]
    chain = make_chain(f"hbm-copy-{split_kv}", 8, seed=3)
    src_ids = [9, 2, 14, 3, 4, 5, 0, 11]
    with daemon.client() as owner, daemon.client() as reader:
        reg_owner = owner.register(owner_arena.layout, "owner")
        reg_reader = reader.register(reader_arena.layout, "reader")
        before = _hbm(reader)
        dram_hits_before = reader.stats()["tiers"]["dram"]["hits"]
        assert _publish(owner, reg_owner, owner_arena, chain, src_ids) == 8
        assert _hbm(reader)["blocks"] == before["blocks"] + 8
        # The owner's own blocks are never offered back to it.
        assert owner.lookup(chain.namespace, chain.hashes, chain.idents, lease_ttl_s=0) \
            .num_hit == 0
        hit = reader.lookup(chain.namespace, chain.hashes, chain.idents)
        assert hit.num_hit == 8 and hit.tiers == ["hbm"] * 8 and hit.lease_id is not None
        dst_ids = [15, 14, 13, 12, 1, 2, 3, 4]
        assert reader.load(reg_reader, hit.lease_id, dst_ids) == 8
        for i in range(8):
            assert reader_arena.block(dst_ids[i]) == owner_arena.block(src_ids[i]), i
        after = _hbm(reader)
        assert after["hits"] == before["hits"] + 8
        assert after["counters"]["blocks_copied"] == before["counters"]["blocks_copied"] + 8
        stats = reader.stats()
        assert stats["daemon"]["leases_active"] == 0
        assert stats["tiers"]["dram"]["hits"] == dram_hits_before  # DRAM was never asked
        assert reader.release(hit.lease_id) is False  # the load consumed the lease


def test_generation_bumped_after_lookup_fails_that_block(daemon: RunningDaemon,
                                                        arenas: list[ShmArena]) -> None:
    owner_arena, reader_arena = _arena(2), _arena(None)
    arenas += [owner_arena, reader_arena]
    chain = make_chain("hbm-generation", 6, seed=4)
    src_ids = list(range(6))
    with daemon.client() as owner, daemon.client() as reader:
        reg_owner = owner.register(owner_arena.layout, "owner")
        reg_reader = reader.register(reader_arena.layout, "reader")
        _publish(owner, reg_owner, owner_arena, chain, src_ids)
        hit = reader.lookup(chain.namespace, chain.hashes, chain.idents)
        assert hit.num_hit == 6
        before = _hbm(reader)["counters"]
        owner_arena.allocate([3])  # the owner reuses block 3 (before it writes anything)
        owner_arena.array[3 * BLOCK_BYTES:4 * BLOCK_BYTES] = 7
        assert reader.load(reg_reader, hit.lease_id, [10, 11, 12, 13, 14, 15]) == 3
        for i in range(3):
            assert reader_arena.block(10 + i) == owner_arena.block(i)
        after = _hbm(reader)["counters"]
        assert after["generation_failures"] == before["generation_failures"] + 1
        # The stale entry is gone: the hit stops before it now, and it is counted.
        again = reader.lookup(chain.namespace, chain.hashes, chain.idents, lease_ttl_s=0)
        assert again.num_hit == 3
        # A publication that is already stale when it arrives is not indexed.
        assert owner.resident(reg_owner, chain.namespace, [3], chain.hashes[3:4],
                              chain.idents[3:4], [owner_arena.generations.get(3) - 1]) == 0


def test_hbm_and_dram_runs_in_one_lease(daemon: RunningDaemon, arenas: list[ShmArena]) -> None:
    owner_arena, reader_arena = _arena(5), _arena(None)
    arenas += [owner_arena, reader_arena]
    chain = make_chain("hbm-mixed", 9, seed=5)
    with daemon.client() as owner, daemon.client() as reader:
        reg_owner = owner.register(owner_arena.layout, "owner")
        reg_reader = reader.register(reader_arena.layout, "reader")
        # Blocks 0-2 and 6-8 only in the owner's arena, 3-5 only in DRAM.
        _publish(owner, reg_owner, owner_arena, chain, [0, 1, 2])
        assert owner.save(reg_owner, chain.namespace, [3, 4, 5], chain.hashes[3:6],
                          chain.idents[3:6]).num_saved == 3
        _publish(owner, reg_owner, owner_arena, chain, [6, 7, 8], first=6)
        hit = reader.lookup(chain.namespace, chain.hashes, chain.idents)
        assert hit.tiers == ["hbm"] * 3 + ["dram"] * 3 + ["hbm"] * 3
        assert reader.load(reg_reader, hit.lease_id, list(range(7, 16))) == 9
        for i in range(9):
            assert reader_arena.block(7 + i) == owner_arena.block(i), i
        stats = reader.stats()
        assert stats["daemon"]["leases_active"] == 0 and stats["leases"] == 0
        # A hole in the middle ends the hit there.
        reader.remove(chain.namespace, chain.hashes[4:5])
        hit = reader.lookup(chain.namespace, chain.hashes, chain.idents)
        assert hit.num_hit == 4 and hit.tiers == ["hbm"] * 3 + ["dram"]
        assert reader.release(hit.lease_id) is True


def test_evictions_and_unregister_withdraw_entries(daemon: RunningDaemon,
                                                   arenas: list[ShmArena]) -> None:
    owner_arena, reader_arena = _arena(6), _arena(None)
    arenas += [owner_arena, reader_arena]
    chain = make_chain("hbm-withdraw", 4, seed=6)
    with daemon.client() as owner, daemon.client() as reader:
        reg_owner = owner.register(owner_arena.layout, "owner")
        reader.register(reader_arena.layout, "reader")
        _publish(owner, reg_owner, owner_arena, chain, [0, 1, 2, 3])
        owner.evicted(chain.namespace, chain.hashes[2:3], reg_owner)
        assert reader.lookup(chain.namespace, chain.hashes, chain.idents,
                             lease_ttl_s=0).num_hit == 2
        before = _hbm(reader)["blocks"]
        assert owner.unregister(reg_owner)
        assert _hbm(reader)["blocks"] == before - 3
        assert reader.lookup(chain.namespace, chain.hashes, chain.idents,
                             lease_ttl_s=0).num_hit == 0


def test_a_reader_without_a_compatible_registration_gets_no_hbm_hit(
        daemon: RunningDaemon, arenas: list[ShmArena]) -> None:
    owner_arena, other = _arena(7), _arena(None, num_blocks=4)
    arenas += [owner_arena, other]
    chain = make_chain("hbm-compat", 2, seed=7)
    small = KVLayout(4, (Region(0, 4 * BLOCK_BYTES, 0, BLOCK_BYTES // 2, BLOCK_BYTES // 2),),
                     device="cpu", dtype="uint8", fds=(other.memory.fd,))
    with daemon.client() as owner, daemon.client() as reader, daemon.client() as bystander:
        reg_owner = owner.register(owner_arena.layout, "owner")
        _publish(owner, reg_owner, owner_arena, chain, [0, 1])
        # No registration at all (a tool) and one of another block shape: both miss.
        assert bystander.lookup(chain.namespace, chain.hashes, chain.idents).num_hit == 0
        reader.register(small, "other-shape")
        assert reader.lookup(chain.namespace, chain.hashes, chain.idents).num_hit == 0


def test_owner_killed_drops_its_entries(daemon: RunningDaemon, arenas: list[ShmArena]) -> None:
    reader_arena = _arena(None)
    arenas.append(reader_arena)
    chain = make_chain("hbm-killed", 5, seed=8)
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO_ROOT / "tests")!r})
        from daemon_helpers import make_chain
        from support.arena import ShmArena
        from kvstore.wire.client import Client
        arena = ShmArena(16, 32 * 1024, 9, generations=True)
        chain = make_chain("hbm-killed", 5, seed=8)
        c = Client({str(daemon.socket_path)!r})
        reg = c.register(arena.layout, "doomed-owner")
        gens = arena.allocate(list(range(5)))
        print(c.resident(reg, chain.namespace, list(range(5)), chain.hashes, chain.idents,
                         gens), flush=True)
        time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "5"
        with daemon.client() as reader:
            reg_reader = reader.register(reader_arena.layout, "reader")
            hit = reader.lookup(chain.namespace, chain.hashes, chain.idents)
            assert hit.num_hit == 5 and hit.tiers == ["hbm"] * 5
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            assert wait_until(lambda: reader.lookup(chain.namespace, chain.hashes, chain.idents,
                                                    lease_ttl_s=0).num_hit == 0)
            # The lease taken before the owner died copies nothing: its arena is gone.
            assert reader.load(reg_reader, hit.lease_id, [0, 1, 2, 3, 4]) == 0
            assert reader_arena.block(0) == bytes(BLOCK_BYTES)
            stats = reader.stats()
            assert stats["tiers"]["hbm"]["counters"]["owner_closed_failures"] >= 1
            assert reader.health()["status"] == "ok"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_sizes_and_ids_are_checked_against_the_memory(daemon: RunningDaemon,
                                                       arenas: list[ShmArena]) -> None:
    arena = _arena(10)
    arenas.append(arena)
    chain = make_chain("hbm-checks", 2, seed=9)
    segment = arena.size_bytes
    with daemon.client() as c:
        # A region larger than its shared memory is refused, however it is split.
        larger = dataclasses.replace(arena.layout, num_blocks=NUM_BLOCKS + 1, regions=(
            Region(0, segment + BLOCK_BYTES, 0, BLOCK_BYTES, BLOCK_BYTES),))
        with pytest.raises(ClientError) as info:
            c.register(larger, "e")
        assert info.value.code == "bad_request" and "exceeds its memory" in info.value.message
        # Generations too short for the layout's blocks are refused too.
        short = BlockGenerations(NUM_BLOCKS // 2)
        try:
            with pytest.raises(ClientError) as info:
                c.register(dataclasses.replace(arena.layout, generations=None,
                                               fds=arena.layout.fds[:1]).with_generations(
                                                   short.fd), "e")
            assert info.value.code == "bad_request" and "generations" in info.value.message
        finally:
            short.close()
        reg = c.register(arena.layout, "e")
        with pytest.raises(ClientError) as info:
            c.resident(reg, chain.namespace, [0, NUM_BLOCKS], chain.hashes, chain.idents, [1, 1])
        assert info.value.code == "bad_request" and "out of range" in info.value.message
        # A layout without generations cannot publish resident blocks (its memory registered
        # again once the first registration is gone: memory is registered once at a time).
        assert c.unregister(reg)
        plain = c.register(dataclasses.replace(arena.layout, generations=None), "plain")
        with pytest.raises(ClientError) as info:
            c.resident(plain, chain.namespace, [0], chain.hashes[:1], chain.idents[:1], [1])
        assert info.value.code == "bad_request"
        assert c.health()["status"] == "ok"
