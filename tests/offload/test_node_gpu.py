"""GPU, two devices: one daemon, an engine on ``cuda:0`` and engines on ``cuda:1``.

A prefix computed on GPU 0 reaches an engine on GPU 1 both ways, byte for byte: copied device
to device from the first engine's arena while it holds the blocks (the HBM tier, peer access:
usage says ``hbm_peer``, the daemon counts ``blocks_copied_peer_gpu``), and loaded from the
daemon's DRAM once the first engine is gone (usage says ``dram``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from daemon_helpers import REPO_ROOT, start_daemon, wait_until
from support.gpus import num_cuda_devices

from engine import LLM, SamplingParams
from engine.make_model import write_checkpoint

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
NUM_BLOCKS = 20

_OWNER = textwrap.dedent("""
    import time
    import cupy as cp
    import numpy as np
    from engine import LLM, SamplingParams
    from kvstore.keys import block_hashes
    llm = LLM({model!r}, device="cuda:0", kv_offload=True, kv_store_socket={socket!r},
              num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = {prompt!r}
    out = llm.generate([prompt], params)[0]
    llm.engine.offload.wait_idle()  # its write-through saves are in the daemon's DRAM
    bm = llm.engine.block_manager
    keys = block_hashes(llm.engine.namespace("").digest, prompt, 16)[:{num_blocks}]
    kv = llm.engine.kv_cache.array[[bm._by_key[k] for k in keys]]
    np.save({blocks!r}, cp.asnumpy(kv.view(cp.uint16)))
    print("tokens", " ".join(map(str, out.token_ids)), flush=True)
    time.sleep(300)
""")


def _blocks(llm: LLM, prompt: list[int]) -> np.ndarray:
    import cupy as cp

    from kvstore.keys import block_hashes

    bm = llm.engine.block_manager
    keys = block_hashes(llm.engine.namespace("").digest, prompt, 16)[:NUM_BLOCKS]
    return cp.asnumpy(llm.engine.kv_cache.array[[bm._by_key[k] for k in keys]].view(cp.uint16))


def _restore_on_cuda1(model: Path, socket_path: Path, prompt: list[int], tokens: list[int],
                      blocks_file: Path, tier: str) -> None:
    """A fresh engine on cuda:1 answers ``prompt`` as the owner did, its prefix restored from
    ``tier``, byte for byte."""
    llm = LLM(str(model), device="cuda:1", kv_offload=True, num_kv_blocks=128,
              kv_store_socket=str(socket_path), kv_offload_restore="always")
    try:
        out = llm.generate([prompt], GREEDY)[0]
        assert out.token_ids == tokens
        assert out.cached_tokens_by_tier[tier] == NUM_BLOCKS * 16, out.cached_tokens_by_tier
        assert np.array_equal(_blocks(llm, prompt), np.load(blocks_file))
    finally:
        llm.close()


@pytest.mark.skipif(num_cuda_devices() < 2, reason="needs two GPUs")
def test_a_prefix_from_cuda0_reaches_cuda1_by_peer_copy_and_from_dram(tmp_path: Path) -> None:
    model = tmp_path / "model"
    write_checkpoint(model, "tiny", seed=0)
    daemon = start_daemon(tmp_path, dram="256MiB", http=False)
    prompt = np.random.default_rng(8).integers(10, 1000, 16 * NUM_BLOCKS + 3).tolist()
    owner_blocks = tmp_path / "owner.npy"
    script = _OWNER.format(model=str(model), socket=str(daemon.socket_path), prompt=prompt,
                           num_blocks=NUM_BLOCKS, blocks=str(owner_blocks))
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, text=True)

    def tiers() -> dict:
        with daemon.client() as c:
            return c.stats()["tiers"]

    try:
        line = child.stdout.readline().split()
        assert line and line[0] == "tokens", "the engine on cuda:0 did not start"
        owner_tokens = [int(t) for t in line[1:]]
        assert wait_until(lambda: tiers()["hbm"]["blocks"] >= NUM_BLOCKS, timeout_s=20.0)
        _restore_on_cuda1(model, daemon.socket_path, prompt, owner_tokens, owner_blocks,
                          "hbm_peer")
        counters = tiers()["hbm"]["counters"]
        assert counters["blocks_copied_peer_gpu"] == NUM_BLOCKS, counters
        child.kill()
        child.wait(10)
        assert wait_until(lambda: tiers()["hbm"]["blocks"] == 0, timeout_s=10.0)
        assert tiers()["dram"]["blocks"] >= NUM_BLOCKS
        _restore_on_cuda1(model, daemon.socket_path, prompt, owner_tokens, owner_blocks, "dram")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        daemon.stop()
