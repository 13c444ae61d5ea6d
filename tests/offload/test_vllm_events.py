"""The vLLM connector's KV events and cache reset, without vLLM: a real daemon, the connector's
scheduler and worker sides (``test_vllm_core``'s instances), vLLM-like block hashes.

A block is announced stored (medium CPU) only once a worker reports the daemon holds it; a
lookup re-announces a block the daemon moved to SSD (STORAGE) and removes one it no longer has;
another instance announces what it finds; a reset removes everything and the old blocks are never
found again."""

from __future__ import annotations

import pytest
from daemon_helpers import wait_until
from test_vllm_core import BLOCK_SIZE, Instance, make_instance, prompt

from offload.vllm.block_events import BlockEvents, BlockInfo, BlocksRemoved, BlocksStored
from offload.vllm.scheduler_side import ScheduledRequest

NUM_BLOCKS = 6


def vllm_hashes(seed: int) -> list[bytes]:
    """Stand-ins for vLLM's own block hashes (32 bytes, as its sha256)."""
    return [bytes([seed, i]) * 16 for i in range(NUM_BLOCKS)]


def store_and_report(inst: Instance, rid: str, tokens: list[int], names: list[bytes]) -> None:
    assert inst.scheduler.match(rid, tokens, 0, None, None, block_hashes=names) == 0
    inst.scheduler.after_alloc(rid, list(range(NUM_BLOCKS + 1)), 0)
    plan = inst.scheduler.plan_step([ScheduledRequest(rid, 0, len(tokens), None)])
    inst.worker.save(plan)
    inst.worker.drain(5.0)
    assert inst.scheduler.events.take() == []  # planned is not stored: nothing yet
    inst.scheduler.saved(inst.worker.take_stored())
    inst.scheduler.saves_ended([rid])


def test_saved_blocks_are_announced_and_removed_blocks_too(make_daemon) -> None:
    daemon = make_daemon(dram="32MiB")
    a = make_instance(daemon.socket_path, 1)
    b = make_instance(daemon.socket_path, None)
    tokens, names = prompt(3, NUM_BLOCKS), vllm_hashes(3)
    store_and_report(a, "r1", tokens, names)
    (stored,) = a.scheduler.events.take()
    assert stored == BlocksStored(names, None, tokens[:NUM_BLOCKS * BLOCK_SIZE], BLOCK_SIZE,
                                  "CPU", "LOCAL", None)

    # Another instance on the daemon finds them: it can load them, so it announces them too.
    assert b.scheduler.match("r2", tokens, 0, None, None, block_hashes=names) > 0
    (found,) = b.scheduler.events.take()
    assert found.block_hashes == names and found.medium == "CPU"

    # The daemon drops blocks 3..: the next lookup ends at block 3, which is announced gone.
    keys = a.scheduler.keys.keys(tokens)
    with daemon.client() as c:
        assert c.remove(keys.namespace, keys.hashes[3:]) == NUM_BLOCKS - 3
    assert a.scheduler.match("r3", tokens, 0, None, None, block_hashes=names) == 3 * BLOCK_SIZE
    assert a.scheduler.events.take() == [BlocksRemoved([names[3]], "CPU", "LOCAL")]

    # A reset removes every block still announced, and the old blocks are never found again.
    a.scheduler.reset()
    (removed,) = a.scheduler.events.take()
    assert removed.medium == "CPU" and set(removed.block_hashes) == {
        names[0], names[1], names[2], names[4], names[5]}
    assert a.scheduler.match("r4", tokens, 0, None, None, block_hashes=names) == 0
    assert b.scheduler.match("r5", tokens, 0, None, None, block_hashes=names) > 0  # not reset
    for inst in (a, b):
        inst.worker.close()
        inst.scheduler.client.close()


def test_a_block_demoted_to_ssd_is_announced_there(make_daemon, tmp_path) -> None:
    daemon = make_daemon(dram="2MiB", ssd_dir=tmp_path / "ssd", ssd_size="64MiB")
    a = make_instance(daemon.socket_path, 2)
    tokens, names = prompt(4, NUM_BLOCKS), vllm_hashes(4)
    store_and_report(a, "r1", tokens, names)
    assert a.scheduler.events.take()[0].medium == "CPU"
    with daemon.client() as c:  # DRAM pressure: the saved blocks are demoted to SSD
        for i in range(16):
            c.put(b"filler-%d" % i, bytes(256 << 10))
        assert wait_until(lambda: c.stats()["tiers"]["ssd"]["blocks"] >= NUM_BLOCKS, 10.0)
    n = a.scheduler.match("r2", tokens, 0, None, None, block_hashes=names)
    assert n > 0
    tiers = a.scheduler.hit_tiers("r2")
    moved = [names[i] for i, tier in enumerate(tiers) if tier == "ssd"]
    assert moved, tiers
    events = a.scheduler.events.take()
    removed = [e for e in events if isinstance(e, BlocksRemoved)]
    stored = [e for e in events if isinstance(e, BlocksStored)]
    assert [h for e in removed for h in e.block_hashes] == moved
    assert all(e.medium == "CPU" for e in removed)
    assert [h for e in stored if e.medium == "STORAGE" for h in e.block_hashes] == moved
    a.worker.close()
    a.scheduler.client.close()


def _info(i: int) -> BlockInfo:
    return BlockInfo(bytes([i]), bytes([i - 1]) if i else None, (i,) * 4)


@pytest.mark.parametrize("tiers,expect", [
    (["dram"] * 4, [("stored", [0, 1, 2, 3], "CPU", "LOCAL")]),
    (["dram", "dram", "ssd", "remote"], [("stored", [0, 1], "CPU", "LOCAL"),
                                         ("stored", [2], "STORAGE", "LOCAL"),
                                         ("stored", [3], "CPU", "REMOTE")]),
])
def test_found_blocks_are_announced_in_runs_per_place(tiers, expect) -> None:
    events = BlockEvents(block_size=4)
    events.looked_up([b"h%d" % i for i in range(4)], 4, tiers, _info)
    got = [("stored", [h[0] for h in e.block_hashes], e.medium, e.locality)
           for e in events.take()]
    assert got == expect
    events.looked_up([b"h%d" % i for i in range(4)], 4, tiers, _info)
    assert events.take() == []  # nothing changed: nothing said


def test_announcements_are_bounded() -> None:
    events = BlockEvents(block_size=4, max_announced=3)
    events.looked_up([b"h%d" % i for i in range(5)], 5, ["dram"] * 5, _info)
    assert events.num_announced == 3
    events.clear()
    (removed,) = [e for e in events.take() if isinstance(e, BlocksRemoved)]
    assert [h[0] for h in removed.block_hashes] == [2, 3, 4]
