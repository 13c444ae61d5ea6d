"""GPU: the HBM tier, blocks copied device to device between two engines' arenas on one GPU.

The daemon opens both arenas by CUDA IPC handle and copies with cudaMemcpyAsync on its
device-to-device stream; the owner's block generations live in host shared memory. First the test
process plays both engines (two connections, two cudaMalloc'd arenas in a Qwen3-4B layout):
byte-exact copies, a generation bump that fails exactly one block, the allocation-size check of
``cuMemGetAddressRange``. Then two real engines in two processes: the second gets the first one's
prefix by copy, byte for byte, with the tokens of an HBM hit.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from daemon_helpers import REPO_ROOT, make_chain, start_daemon, wait_until
from support.arena import CudaArena
from support.gpus import num_cuda_devices

from engine import LLM, SamplingParams
from engine.make_model import write_checkpoint
from kvstore.wire.client import ClientError

pytestmark = pytest.mark.gpu

BLOCK_BYTES = 36 * 2 * 16 * 8 * 128 * 2  # Qwen3-4B: layers x K,V x tokens x KV heads x dim x bf16
NUM_BLOCKS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _arena(num_blocks: int, seed: int | None) -> CudaArena:
    """``kv[num_blocks, BLOCK_BYTES]`` in its own cudaMalloc, plus block generations."""
    return CudaArena(num_blocks, BLOCK_BYTES, seed)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    running = start_daemon(tmp_path_factory.mktemp("hbm-gpu"), dram="256MiB", http=False)
    yield running
    assert running.stop() == 0, "\n".join(running.lines)


def test_device_to_device_copies_are_byte_exact_and_generation_checked(daemon) -> None:
    owner_arena, reader_arena = _arena(NUM_BLOCKS, seed=1), _arena(NUM_BLOCKS, seed=None)
    rng = np.random.default_rng(2)
    # Scattered ids (a copy each) and a consecutive run on both sides (coalesced copies).
    src_ids = [int(b) for b in rng.permutation(40)[:24]] + list(range(40, 48))
    dst_ids = [int(b) for b in rng.permutation(NUM_BLOCKS - 16)[:24]] + list(range(48, 56))
    chain = make_chain("hbm-gpu", len(src_ids), seed=3)
    with daemon.client(timeout_s=60.0) as owner, daemon.client(timeout_s=60.0) as reader:
        reg_owner = owner.register(owner_arena.layout, "owner")
        reg_reader = reader.register(reader_arena.layout, "reader")
        assert owner.resident(reg_owner, chain.namespace, src_ids, chain.hashes, chain.idents,
                              owner_arena.allocate(src_ids)) == len(src_ids)
        hit = reader.lookup(chain.namespace, chain.hashes, chain.idents)
        assert hit.num_hit == len(src_ids) and set(hit.tiers) == {"hbm"}
        before = reader_arena.kv.get()
        assert reader.load(reg_reader, hit.lease_id, dst_ids) == len(src_ids)
        after = reader_arena.kv.get()
        assert np.array_equal(after[dst_ids], owner_arena.blocks(src_ids))
        untouched = sorted(set(range(NUM_BLOCKS)) - set(dst_ids))
        assert np.array_equal(after[untouched], before[untouched])

        # The owner reallocates block 10 of the chain after the lookup: the load stops there.
        hit = reader.lookup(chain.namespace, chain.hashes, chain.idents)
        owner_arena.allocate([src_ids[10]])
        reader_arena.kv[...] = 0
        assert reader.load(reg_reader, hit.lease_id, dst_ids) == 10
        assert np.array_equal(reader_arena.blocks(dst_ids[:10]),
                              owner_arena.blocks(src_ids[:10]))
        hbm = reader.stats()["tiers"]["hbm"]
        assert hbm["counters"]["generation_failures"] == 1
        assert hbm["counters"]["blocks_copied"] == len(src_ids) + 10
        assert reader.lookup(chain.namespace, chain.hashes, chain.idents,
                             lease_ttl_s=0).num_hit == 10
        assert owner.unregister(reg_owner)
        assert reader.stats()["tiers"]["hbm"]["registrations"] == 0


def test_sizes_and_block_ids_are_checked_against_the_allocation(daemon) -> None:
    arena = _arena(8, seed=4)
    region = arena.layout.regions[0]
    with daemon.client(timeout_s=60.0) as c:
        # The engine claims twice the memory its IPC handle has: the driver's size wins.
        claims = dataclasses.replace(region, size_bytes=2 * region.size_bytes)
        with pytest.raises(ClientError) as info:
            c.register(dataclasses.replace(arena.layout, num_blocks=16, regions=(claims,)), "e")
        assert info.value.code == "bad_request"
        assert "exceeds the CUDA allocation" in info.value.message
        reg = c.register(arena.layout, "e")  # the same handle, honestly described, maps fine
        chain = make_chain("hbm-gpu-ids", 2, seed=5)
        with pytest.raises(ClientError) as info:
            c.resident(reg, chain.namespace, [0, 8], chain.hashes, chain.idents, [1, 1])
        assert info.value.code == "bad_request" and "out of range" in info.value.message
        assert c.health()["status"] == "ok"


_OWNER_ENGINE = textwrap.dedent("""
    import time
    import cupy as cp
    import numpy as np
    from engine import LLM, SamplingParams
    from kvstore.keys import block_hashes
    llm = LLM({model!r}, device="cuda", kv_offload=True, kv_store_socket={socket!r},
              num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = {prompt!r}
    llm.generate([prompt], params)
    hit = llm.generate([prompt], params)[0]  # an HBM hit of the whole prefix
    bm = llm.engine.block_manager
    keys = block_hashes(llm.engine.namespace("").digest, prompt, 16)[:{num_blocks}]
    kv = llm.engine.kv_cache.array[[bm._by_key[k] for k in keys]]
    np.save({blocks!r}, cp.asnumpy(kv.view(cp.uint16)))
    print("tokens", " ".join(map(str, hit.token_ids)), flush=True)
    time.sleep(300)
""")


def test_two_engines_in_two_processes_share_a_prefix(tmp_path: Path) -> None:
    import cupy as cp

    from kvstore.keys import block_hashes

    model = tmp_path / "model"
    write_checkpoint(model, "tiny", seed=0)
    daemon = start_daemon(tmp_path, dram="64MiB", http=False)
    prompt = np.random.default_rng(6).integers(10, 1000, 16 * 20 + 3).tolist()
    blocks_file = tmp_path / "owner-blocks.npy"
    script = _OWNER_ENGINE.format(model=str(model), socket=str(daemon.socket_path),
                                  prompt=prompt, num_blocks=20, blocks=str(blocks_file))
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().split()
        assert line and line[0] == "tokens", "the owner engine did not start"
        owner_tokens = [int(t) for t in line[1:]]

        def hbm_blocks() -> int:
            with daemon.client() as c:
                return c.stats()["tiers"]["hbm"]["blocks"]

        assert wait_until(lambda: hbm_blocks() >= 20, timeout_s=20.0)
        reader = LLM(str(model), device="cuda", kv_offload=True, num_kv_blocks=128,
                     kv_store_socket=str(daemon.socket_path), kv_offload_restore="always")
        out = reader.generate([prompt], GREEDY)[0]
        assert out.cached_tokens_by_tier["hbm_peer"] == 20 * 16  # another engine's arena
        assert out.token_ids == owner_tokens
        bm = reader.engine.block_manager
        keys = block_hashes(reader.engine.namespace("").digest, prompt, 16)[:20]
        mine = cp.asnumpy(reader.engine.kv_cache.array[[bm._by_key[k] for k in keys]]
                          .view(cp.uint16))
        assert np.array_equal(mine, np.load(blocks_file))
        reader.close()
        with daemon.client() as c:
            hbm = c.stats()["tiers"]["hbm"]
        assert hbm["hits"] == 20 and hbm["counters"]["blocks_copied"] == 20
        child.kill()
        child.wait(10)
        assert wait_until(lambda: hbm_blocks() == 0, timeout_s=10.0)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        daemon.stop()


@pytest.mark.parametrize("reader_device", [0, 1])
def test_hbm_copy_benchmark_path_lands_every_block(reader_device: int, tmp_path: Path) -> None:
    """``benchmarks.hbm_copy`` as a test, at the sizes a node moves (64, 256 and 1,024 blocks of
    2.36 MB, shuffled and consecutive): every load counts all its blocks and the last lands
    byte-exact. ``reader_device`` 1: the daemon copies across GPUs (on H200s this read an
    illegal address and broke the daemon's context before the peer mapping was opened on the
    reading device)."""
    if reader_device and num_cuda_devices() < 2:
        pytest.skip("needs two GPUs")
    done = subprocess.run([sys.executable, "-m", "benchmarks.hbm_copy", "--reps", "2",
                           "--reader-device", str(reader_device), "--out", str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "byte-exact: True" in done.stdout
    assert "illegal" not in done.stdout + done.stderr
