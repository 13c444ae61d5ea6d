"""No first-use cost after the warm-up (issue 36 item 1), on a GPU: once the engine is warm, the
turns a restore or an HBM hit produces (a short prefill of each length class over a long cached
prefix, one to four at once) and the decode batches after them build no CUDA graph and no cuDNN
graph; no request is the first to need a kernel module (ours by NVRTC, or CuPy's own: a cold
CuPy cache compiles each in about two seconds); and a second start loads its cuDNN graphs from
the plan cache instead of building them."""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, SamplingParams
from kernels.build_log import CUDA_GRAPH, CUDNN_GRAPH, CUDNN_LOAD, KERNEL_MODULE

pytestmark = pytest.mark.gpu


def _after(llm: LLM) -> dict:
    return dict(llm.engine.runner.ops.builds.snapshot()["after"])


def _from_builder(llm: LLM) -> int:
    """Graphs of the background builder loaded so far: in a request's path or not."""
    from kernels.build_log import CUDNN_BACKGROUND

    snap = llm.engine.runner.ops.builds.snapshot()
    return snap["after"].get(CUDNN_BACKGROUND, 0) + snap["hidden"].get(CUDNN_BACKGROUND, 0)


def test_turns_after_the_warm_up_wait_for_no_build(tiny_model_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_CUDNN_PLAN_CACHE", str(tmp_path / "plans"))
    rng = np.random.default_rng(0)
    with LLM(str(tiny_model_dir), device="cuda", max_num_seqs=8, max_model_len=4096) as llm:
        llm.engine.warm_up()
        vocab = llm.engine.vocab_size
        bases = [rng.integers(0, vocab, n).tolist() for n in (1200, 1500, 2000, 900)]
        # cold prompts run eagerly: a new long shape's attention graph is built by the
        # builder process while our kernel serves it, never in a request's path
        llm.generate(bases, SamplingParams(max_tokens=4, ignore_eos=True))
        histories = [b + rng.integers(0, vocab, 16 - len(b) % 16).tolist() for b in bases]
        # the turns' length classes, one to four at once (a step of at most 256 new tokens
        # replays a graph; longer ones run eagerly, as every cold prefill does)
        for group, new_tokens in ((1, 8), (1, 40), (1, 100), (1, 200), (2, 8), (2, 100),
                                  (3, 40), (3, 60), (4, 8), (4, 40)):
            prompts = [h + rng.integers(0, vocab, new_tokens).tolist()
                       for h in histories[:group]]
            outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
            assert all(o.num_cached_tokens >= len(h) - 16 for o, h in zip(outs, histories))
        after = _after(llm)  # not one capture or build a request waited for
        assert after.get(CUDA_GRAPH, 0) == after.get(CUDNN_GRAPH, 0) == 0, after
        assert after.get(CUDNN_LOAD, 0) == 0, after
        assert llm.engine.runner.prefill_graphs.num_replays >= 10
        allocator = llm.engine.runner.ops.allocator_bytes  # what the soak's memory check reads
        assert allocator["held"] >= allocator["in_use"] > 0, allocator


def test_a_second_start_loads_its_cudnn_graphs(tiny_model_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_CUDNN_PLAN_CACHE", str(tmp_path / "plans"))
    with LLM(str(tiny_model_dir), device="cuda", max_num_seqs=4, max_model_len=2048) as llm:
        if "cudnn" not in llm.engine.runner.attention_backend:
            pytest.skip(f"no cuDNN attention: {llm.engine.runner.attention_backend}")
        llm.engine.warm_up()
        first = llm.engine.runner.ops.builds.snapshot()["before"]
        text = llm.generate([[5] * 40], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    assert first.get(CUDNN_GRAPH, 0) > 0
    with LLM(str(tiny_model_dir), device="cuda", max_num_seqs=4, max_model_len=2048) as llm:
        llm.engine.warm_up()
        second = llm.engine.runner.ops.builds.snapshot()["before"]
        again = llm.generate([[5] * 40], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    assert second.get(CUDNN_GRAPH, 0) == 0
    assert second.get(CUDNN_LOAD, 0) == first[CUDNN_GRAPH]
    assert again == text  # a loaded plan computes what the built one did


def _cached_kernels(directory) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


def test_no_request_compiles_a_kernel_after_the_warm_up(tiny_model_dir, tmp_path,
                                                         monkeypatch) -> None:
    """Cold CuPy cache, fresh plan cache: every module this process needs is compiled in this
    test (the module cache is cleared), and the first requests of every kind after ready add
    no module (ours) and no file to CuPy's kernel cache (CuPy's own), while our attention
    kernels serve the multi-sequence shapes cuDNN has no graph for yet."""
    from kernels import cuda_module  # CuPy's side of the package: GPU machines only

    cupy_cache = tmp_path / "cupy"
    monkeypatch.setenv("CUPY_CACHE_DIR", str(cupy_cache))
    monkeypatch.setenv("KVSTORE_CUDNN_PLAN_CACHE", str(tmp_path / "plans"))
    cuda_module._module.cache_clear()
    rng = np.random.default_rng(1)
    with LLM(str(tiny_model_dir), device="cuda", max_num_seqs=8, max_model_len=4096) as llm:
        llm.engine.warm_up()
        before = _cached_kernels(cupy_cache)
        assert llm.engine.runner.ops.builds.snapshot()["before"][KERNEL_MODULE] >= 4
        vocab = llm.engine.vocab_size
        prompts = [rng.integers(0, vocab, n).tolist() for n in (700, 90, 60, 1500, 300)]
        llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))  # cold, together
        sampled = SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.02,
                                 repetition_penalty=1.2, presence_penalty=0.3,
                                 frequency_penalty=0.3, logit_bias={5: 1.5}, min_tokens=2,
                                 logprobs=3, seed=4, max_tokens=5)
        llm.generate(prompts[:3], sampled)
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, prompt_logprobs=2,
                                                 structured_outputs={"choice": ["yes", "no"]}))
        after = _after(llm)
        assert after.get(KERNEL_MODULE, 0) == 0, after
        assert _cached_kernels(cupy_cache) == before
        if "cudnn" in llm.engine.runner.attention_backend:
            assert llm.engine.runner.ops.num_attention_fallbacks > 0  # ours served some shape


def test_a_warm_restart_loads_the_graphs_its_requests_met(tiny_model_dir, tmp_path,
                                                          monkeypatch) -> None:
    """A long cold prefill's shape is not the warm-up's: the first start meets it after ready
    (built by the builder process, loaded beside a step). The next start with the same arena loads
    it before ready (``kernels/plan_shapes.py``): its requests then load no graph at all."""
    import time

    from kernels.build_log import CUDNN_BACKGROUND

    monkeypatch.setenv("KVSTORE_CUDNN_PLAN_CACHE", str(tmp_path / "plans"))
    rng = np.random.default_rng(2)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    kwargs = dict(device="cuda", max_num_seqs=4, max_model_len=4096, num_kv_blocks=1024)
    with LLM(str(tiny_model_dir), **kwargs) as llm:
        if "cudnn" not in llm.engine.runner.attention_backend:
            pytest.skip(f"no cuDNN attention: {llm.engine.runner.attention_backend}")
        llm.engine.warm_up()
        vocab = llm.engine.vocab_size
        deadline = time.monotonic() + 120
        while _from_builder(llm) == 0:  # fresh tokens: a cold prefill each
            assert time.monotonic() < deadline, _after(llm)
            llm.generate([rng.integers(0, vocab, 1500).tolist()], params)
            time.sleep(0.2)
        met = _from_builder(llm)
    with LLM(str(tiny_model_dir), **kwargs) as llm:
        llm.engine.warm_up()
        assert llm.engine.runner.num_preloaded_plans >= met
        for _ in range(3):
            llm.generate([rng.integers(0, vocab, 1500).tolist()], params)
        after = _after(llm)
    assert after.get(CUDNN_LOAD, 0) == after.get(CUDNN_BACKGROUND, 0) == 0, after
    assert after.get(CUDNN_GRAPH, 0) == 0, after


def test_a_graph_built_after_ready_is_loaded_in_idle_time_not_by_a_request(
        tiny_model_dir, tmp_path, monkeypatch) -> None:
    """A cold prefill's new shape goes to the builder process; once its graph is back, the
    idle engine loads it (``use_idle_time``, which the server's step thread calls while no
    request is left), counted as hidden: the next request of that shape loads nothing."""
    import time

    from kernels.build_log import CUDNN_BACKGROUND

    monkeypatch.setenv("KVSTORE_CUDNN_PLAN_CACHE", str(tmp_path / "plans"))
    rng = np.random.default_rng(3)
    params = SamplingParams(max_tokens=1)  # no decode step that could load it first
    kwargs = dict(device="cuda", max_num_seqs=4, max_model_len=4096, num_kv_blocks=1024)
    with LLM(str(tiny_model_dir), **kwargs) as llm:
        if "cudnn" not in llm.engine.runner.attention_backend:
            pytest.skip(f"no cuDNN attention: {llm.engine.runner.attention_backend}")
        llm.engine.warm_up()
        vocab = llm.engine.vocab_size
        llm.generate([rng.integers(0, vocab, 1500).tolist()], params)
        ops = llm.engine.runner.ops
        deadline = time.monotonic() + 120
        while ops.background_builds.get("built", 0) == 0:
            assert time.monotonic() < deadline, ops.background_builds
            time.sleep(0.05)
        assert _from_builder(llm) == 0  # back, not loaded yet
        llm.engine.use_idle_time()
        snap = ops.builds.snapshot()
        assert snap["hidden"].get(CUDNN_BACKGROUND, 0) >= 1, snap
        llm.generate([rng.integers(0, vocab, 1500).tolist()], params)
        after = _after(llm)
    assert after.get(CUDNN_BACKGROUND, 0) == after.get(CUDNN_GRAPH, 0) == 0, after
