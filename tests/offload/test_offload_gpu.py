"""GPU: --kv-offload end to end on CUDA: engine arena registered over IPC with a real daemon.

A restore is byte-exact, so the tokens after a DRAM or SSD restore must equal the tokens after an
HBM hit of the same prefix (same KV bytes, same computation of the rest); the restored blocks'
bytes must equal the ones the first engine computed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from daemon_helpers import start_daemon

from engine import LLM, SamplingParams
from engine.make_model import write_checkpoint

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-gpu") / "model"
    write_checkpoint(out, "tiny", seed=0)
    return out


def _blocks(llm: LLM, block_ids: list[int]) -> np.ndarray:
    import cupy as cp

    return cp.asnumpy(llm.engine.kv_cache.array[block_ids].view(cp.uint16))


def test_dram_and_ssd_restores_match_the_hbm_hit(model_dir: Path, tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    daemon = start_daemon(tmp_path, dram="256MiB", ssd_dir=ssd, ssd_size="256MiB", http=False)
    try:
        prompt = np.random.default_rng(0).integers(10, 1000, 16 * 20 + 3).tolist()
        first = LLM(str(model_dir), device="cuda", kv_offload=True, num_kv_blocks=128,
                    kv_store_socket=str(daemon.socket_path))
        first.generate([prompt], GREEDY)
        hbm = first.generate([prompt], GREEDY)[0]
        assert hbm.cached_tokens_by_tier["hbm"] == 20 * 16
        seq_blocks = [first.engine.block_manager._by_key[h] for h in _hashes(first, prompt)]
        computed = _blocks(first, seq_blocks)
        first.engine.offload.wait_idle()
        first.close()

        second = LLM(str(model_dir), device="cuda", kv_offload=True, num_kv_blocks=128,
                     kv_store_socket=str(daemon.socket_path))
        dram = second.generate([prompt], GREEDY)[0]
        assert dram.cached_tokens_by_tier["dram"] == 20 * 16
        assert dram.token_ids == hbm.token_ids
        restored = _blocks(second, [second.engine.block_manager._by_key[h]
                                    for h in _hashes(second, prompt)])
        assert np.array_equal(restored, computed)
        second.close()

        daemon.stop()  # SIGTERM flushes DRAM to SSD
        daemon = start_daemon(tmp_path, dram="256MiB", ssd_dir=ssd, ssd_size="256MiB",
                              http=False)
        third = LLM(str(model_dir), device="cuda", kv_offload=True, num_kv_blocks=128,
                    kv_store_socket=str(daemon.socket_path))
        from_ssd = third.generate([prompt], GREEDY)[0]
        third.close()
        assert from_ssd.cached_tokens_by_tier["ssd"] == 20 * 16
        assert from_ssd.token_ids == hbm.token_ids
    finally:
        daemon.stop()


def _hashes(llm: LLM, prompt: list[int]) -> list[bytes]:
    from kvstore.keys import block_hashes

    digest = llm.engine.namespace("").digest
    return block_hashes(digest, prompt, 16)[:20]


def test_a_likely_hit_restored_ahead_is_byte_exact(model_dir: Path, tmp_path: Path) -> None:
    """One engine's own prefix, evicted from its HBM, comes back through a ``lookup_load``
    (restored ahead: the daemon loads it in the lookup's round trip) with the bytes it had."""
    daemon = start_daemon(tmp_path, dram="256MiB", http=False)
    try:
        a = np.random.default_rng(1).integers(10, 1000, 16 * 20 + 3).tolist()
        b = np.random.default_rng(2).integers(10, 1000, 16 * 20 + 3).tolist()
        llm = LLM(str(model_dir), device="cuda", kv_offload=True, num_kv_blocks=32,
                  kv_store_socket=str(daemon.socket_path), kv_offload_restore="always")
        try:
            llm.generate([a], GREEDY)
            hit = llm.generate([a], GREEDY)[0]
            assert hit.cached_tokens_by_tier["hbm"] == 20 * 16
            computed = _blocks(llm, [llm.engine.block_manager._by_key[h]
                                     for h in _hashes(llm, a)])
            llm.generate([b], GREEDY)  # 32 blocks: b's 21 evict a's
            llm.engine.offload.wait_idle()
            back = llm.generate([a], GREEDY)[0]
            assert back.cached_tokens_by_tier["dram"] > 0
            assert back.token_ids == hit.token_ids
            stats = llm.engine.stats()["kv_offload"]
            assert stats["restores_landed_ahead"] == 1
            restored = _blocks(llm, [llm.engine.block_manager._by_key[h]
                                     for h in _hashes(llm, a)])
            assert np.array_equal(restored, computed)
        finally:
            llm.close()
    finally:
        daemon.stop()
