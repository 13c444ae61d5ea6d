"""The HBM tier end to end on CPU: a second engine copies the prefix out of the first one's arena.

A real daemon whose DRAM cannot hold a single block (every write-through save fails), so the only
place a prefix can come from is another live engine's KV arena. The greedy tokens must equal an
engine without any cache; an owner that reuses its blocks, or dies, costs only recompute.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from daemon_helpers import REPO_ROOT, wait_until

from engine import LLM, SamplingParams
from engine.sequence import SequenceStatus

pytestmark = pytest.mark.timeout(180)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
NO_DRAM = "4KiB"  # smaller than one tiny-model block (8 KiB): nothing is ever saved


def _prompt(num_tokens: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 1000, num_tokens).tolist()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", enable_prefix_caching=False, num_kv_blocks=64)
    yield lambda prompt: llm.generate([prompt], GREEDY)[0].token_ids
    llm.close()


def _engine(model_dir, daemon, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(str(model_dir), device="cpu", kv_offload=True,
               kv_store_socket=str(daemon.socket_path), **kwargs)


def _hbm_stats(daemon) -> dict:
    with daemon.client() as c:
        return c.stats()["tiers"]["hbm"]


def _blocks_of(llm: LLM, prompt: list[int], num_blocks: int) -> np.ndarray:
    from kvstore.keys import block_hashes

    bm = llm.engine.block_manager
    keys = block_hashes(llm.engine.namespace("").digest, prompt, bm.block_size)[:num_blocks]
    return llm.engine.kv_cache.array[[bm._by_key[k] for k in keys]].copy()


def test_second_engine_copies_the_prefix_from_the_first(tiny_model_dir, make_daemon,
                                                        reference) -> None:
    daemon = make_daemon(dram=NO_DRAM)
    prompt = _prompt(16 * 12 + 5, seed=21)
    owner = _engine(tiny_model_dir, daemon)
    reader = _engine(tiny_model_dir, daemon)
    try:
        assert owner.generate([prompt], GREEDY)[0].token_ids == reference(prompt)
        assert wait_until(lambda: _hbm_stats(daemon)["blocks"] >= 12)
        out = reader.generate([prompt], GREEDY)[0]
        assert out.token_ids == reference(prompt)
        # another engine's arena on this node: hbm_peer, not this engine's own hbm
        assert out.cached_tokens_by_tier == {"hbm": 0, "hbm_peer": 12 * 16, "dram": 0, "ssd": 0,
                                             "remote": 0}
        assert out.num_cached_tokens == 12 * 16
        # The copied blocks are the owner's bytes, exactly.
        assert np.array_equal(_blocks_of(reader, prompt, 12), _blocks_of(owner, prompt, 12))
        stats = reader.engine.stats()
        assert stats["kv_offload"]["restored_tokens_by_tier"] == {"hbm_peer": 12 * 16}
        assert stats["prefix_cache_hit_tokens"]["hbm_peer"] == 12 * 16
        assert stats["prefix_cache_hit_tokens"]["hbm"] == 0
        # which path: shared memory to shared memory (CPU engines), every block counted
        hbm_counters = _hbm_stats(daemon)["counters"]
        assert hbm_counters["blocks_copied_host"] == hbm_counters["blocks_copied"] == 12
        assert hbm_counters["blocks_copied_peer_gpu"] == hbm_counters["blocks_copied_same_gpu"] == 0
        with daemon.client() as c:
            daemon_stats = c.stats()
        hbm = daemon_stats["tiers"]["hbm"]
        assert hbm["hits"] == 12 and hbm["counters"]["blocks_copied"] == 12
        assert hbm["counters"]["generation_failures"] == 0
        assert daemon_stats["tiers"]["dram"]["blocks"] == 0  # DRAM never had it
        reader.engine.block_manager.check_integrity()
    finally:
        reader.close()
        owner.close()
    assert wait_until(lambda: _hbm_stats(daemon)["blocks"] == 0)  # unregistered: entries go


def test_owner_reusing_its_blocks_shrinks_the_hit_never_the_kv(tiny_model_dir, make_daemon,
                                                               reference) -> None:
    daemon = make_daemon(dram=NO_DRAM)
    prompt = _prompt(16 * 12 + 5, seed=22)
    other = _prompt(16 * 12 + 5, seed=23)
    # 16 blocks: the owner's next prompt has to take most of this prompt's blocks.
    owner = _engine(tiny_model_dir, daemon, num_kv_blocks=16)
    # One sequence at a time: "r" queues behind "busy", its lookup (sent on arrival) answered
    # while it waits, and its load starts only once "busy" is done.
    reader = _engine(tiny_model_dir, daemon, kv_offload_restore="always", max_num_seqs=1)
    try:
        owner.generate([prompt], GREEDY)
        assert wait_until(lambda: _hbm_stats(daemon)["blocks"] >= 12)
        published = _blocks_of(owner, prompt, 12)
        engine = reader.engine
        engine.add_request("busy", _prompt(40, seed=24), SamplingParams(max_tokens=30,
                                                                        ignore_eos=True))
        for _ in range(200):  # on a loaded host its own lookup may answer a step or two late
            engine.step()
            if any(s.request_id == "busy" for s in engine.scheduler.running):
                break
        else:
            raise AssertionError("'busy' never started running")
        engine.add_request("r", prompt, GREEDY)
        engine.step()  # "r" arrives: its lookup is sent, it waits in the queue
        restore = engine.offload.restores.prefetched["r"]
        assert restore.lookup.wait(10.0) and restore.lookup.result.num_hit == 12
        assert restore.lookup.result.tiers == ["hbm"] * 12
        # Between the lookup and the load, the owner reallocates (and overwrites) its blocks.
        owner.engine.reset_prefix_cache()
        assert owner.generate([other], GREEDY)[0].token_ids == reference(other)
        final = None
        for _ in range(500):
            for out in engine.step():
                if out.finished and out.request_id == "r":
                    final = out
            if final is not None:
                break
        assert final is not None and final.token_ids == reference(prompt)
        hbm_tokens = final.cached_tokens_by_tier["hbm_peer"]
        assert hbm_tokens < 12 * 16 and hbm_tokens % 16 == 0
        num_copied = hbm_tokens // 16
        copied = _blocks_of(reader, prompt, num_copied)
        assert np.array_equal(copied, published[:num_copied])  # what arrived is what was there
        counters = _hbm_stats(daemon)["counters"]
        assert counters["generation_failures"] == 1
        assert engine.offload.counters["loads_short"] == 1
        engine.block_manager.check_integrity()
        assert all(s.status is not SequenceStatus.LOADING for s in engine.scheduler.running)
    finally:
        reader.close()
        owner.close()


_OWNER = textwrap.dedent("""
    import sys, time
    from engine import LLM, SamplingParams
    llm = LLM({model!r}, device="cpu", kv_offload=True, kv_store_socket={socket!r},
              num_kv_blocks=64)
    llm.generate([{prompt!r}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    print("ready", flush=True)
    time.sleep(120)
""")


def test_owner_killed_its_blocks_leave_the_index(tiny_model_dir, make_daemon,
                                                 reference) -> None:
    daemon = make_daemon(dram=NO_DRAM)
    prompt = _prompt(16 * 10 + 3, seed=24)
    script = _OWNER.format(model=str(tiny_model_dir), socket=str(daemon.socket_path),
                           prompt=prompt)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert wait_until(lambda: _hbm_stats(daemon)["blocks"] >= 10)
        child.kill()
        child.wait(10)
        assert wait_until(lambda: _hbm_stats(daemon)["blocks"] == 0)
        reader = _engine(tiny_model_dir, daemon)
        out = reader.generate([prompt], GREEDY)[0]
        reader.close()
        assert out.token_ids == reference(prompt)
        assert out.cached_tokens_by_tier["hbm_peer"] == 0 and out.num_cached_tokens == 0
        with daemon.client() as c:
            stats = c.stats()
            assert c.health()["status"] == "ok"
        assert stats["daemon"]["registrations"] == 0 and stats["daemon"]["leases_active"] == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_sharing_off_publishes_nothing(tiny_model_dir, make_daemon, reference) -> None:
    daemon = make_daemon(dram=NO_DRAM)
    prompt = _prompt(16 * 6 + 1, seed=25)
    owner = _engine(tiny_model_dir, daemon, kv_offload_share_hbm=False)
    reader = _engine(tiny_model_dir, daemon)
    try:
        owner.generate([prompt], GREEDY)
        out = reader.generate([prompt], GREEDY)[0]
        assert out.token_ids == reference(prompt)
        assert out.cached_tokens_by_tier["hbm_peer"] == 0
        hbm = _hbm_stats(daemon)
        assert hbm["hits"] == 0 and hbm["registrations"] == 1  # only the reader's blocks
    finally:
        reader.close()
        owner.close()
