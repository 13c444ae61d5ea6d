"""vLLM with tensor parallelism on the kvstore connector: two real vLLM processes on CPU, each
with two tensor-parallel workers, on one real daemon. Every rank stores its own shard of each
block (its KV heads) under its rank's namespace; the second engine loads all of its ranks'
shards from the store and answers as the first did."""

from __future__ import annotations

import os

import pytest
from daemon_helpers import wait_until
from vllm_parts import (
    BLOCK_SIZE,
    assert_same_logprobs,
    dram_blocks,
    engines_up,
    full_blocks_tokens,
    prompt,
    running_daemon,
)

from kvstore.testing.vllm_process import VllmProcess

pytestmark = pytest.mark.vllm

TP = 2
EXTRA = {"lookup_timeout_s": 5.0, "load_timeout_s": 10.0, "save_timeout_s": 10.0}


def _thread_binding() -> str | None:
    """vLLM's CPU workers each bind to CPUs; on one NUMA node they must be told which (``0|1``:
    worker 0 on CPU 0, worker 1 on CPU 1). None with fewer CPUs than workers."""
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(c) for c in cpus[:TP]) if len(cpus) >= TP else None


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("vllm-tp")) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def engines(small_model_dir, store):
    binding = _thread_binding()
    if binding is None:
        pytest.skip(f"tensor parallelism on vLLM's CPU backend needs {TP} CPUs")
    args = {"tensor_parallel_size": TP, "distributed_executor_backend": "mp"}
    env = {"VLLM_CPU_OMP_THREADS_BIND": binding}
    with engines_up({name: VllmProcess(small_model_dir, store.socket_path, EXTRA, wait=False,
                                       engine_args=args, env=env)
                     for name in ("first", "second")}) as procs:
        yield procs


def _blocks_loaded(store) -> int:
    """Blocks the daemon copied into engines' memory (every rank's shard counts once)."""
    with store.client() as c:
        return int(c.stats()["daemon"]["events"].get("blocks_loaded", 0))


def test_every_rank_stores_its_shard_and_a_second_engine_loads_them_all(engines,
                                                                        store) -> None:
    p = prompt(60)
    before = dram_blocks(store)
    first = engines["first"].ask(p)
    assert first["num_cached_tokens"] == 0
    # One block per rank for each full block of the prompt: two shards, one set of keys.
    num_blocks = len(p) // BLOCK_SIZE
    assert wait_until(lambda: dram_blocks(store) >= before + TP * num_blocks, 20.0)
    loaded_before = _blocks_loaded(store)
    second = engines["second"].ask(p)
    hit = full_blocks_tokens(len(p))
    assert second["num_cached_tokens"] == hit
    assert second["external_hits"] >= hit
    # vLLM counts the hit when it schedules the load; the daemon counts what arrived: every
    # rank's every shard (a failed load would be recomputed with the same answer).
    assert _blocks_loaded(store) - loaded_before == TP * (hit // BLOCK_SIZE)
    assert_same_logprobs(second, first)  # both ranks' loaded heads are the ones they computed
