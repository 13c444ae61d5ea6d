"""The engine's public surface: config validation, request API, threads, stats, KV arena."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import random_prompts

from engine import LLM, EngineConfig, LLMEngine, RequestOutput, SamplingParams
from engine.config import resolve_device
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import TIERS
from kvstore.layout import KVLayout


@pytest.fixture()
def engine(tiny_model_dir: Path):
    with LLMEngine(EngineConfig(str(tiny_model_dir), device="cpu", num_kv_blocks=64,
                                max_model_len=256)) as engine:
        yield engine


def run_to_end(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    by_id: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            by_id.setdefault(out.request_id, []).append(out)
    return by_id


@pytest.mark.parametrize("kwargs", [
    {"device": "tpu"}, {"block_size": 0}, {"block_size": 2.0}, {"num_kv_blocks": 0},
    {"max_model_len": -1}, {"gpu_memory_utilization": 0.0}, {"gpu_memory_utilization": 1.5},
    {"max_num_seqs": 0}, {"max_num_batched_tokens": True}, {"kv_offload_policy": "lazy"},
    {"served_model_name": ""}, {"debug_hash_bits": 0}, {"kv_offload": "yes"},
    {"enforce_eager": 1}, {"kv_offload_share_hbm": "no"}, {"max_prefill_graph_tokens": 8},
    {"max_prefill_graph_tokens": 512.0},
])
def test_engine_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        EngineConfig(model_dir="/m", **kwargs)


def test_engine_config_is_frozen_and_defaults() -> None:
    config = EngineConfig(model_dir=Path("/m"))
    assert config.model_dir == "/m" and config.device == "auto" and config.block_size == 16
    assert config.kv_offload_policy == "write-through" and config.num_kv_blocks is None
    with pytest.raises(AttributeError):
        config.block_size = 32  # type: ignore[misc]
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") in ("cpu", "cuda")


def test_capacity_planning(tiny_model_dir: Path) -> None:
    with LLMEngine(EngineConfig(str(tiny_model_dir), device="cpu", num_kv_blocks=10)) as e:
        assert e.max_model_len == 160 and e.stats()["num_kv_blocks"] == 10
    with LLMEngine(EngineConfig(str(tiny_model_dir), device="cpu", max_num_seqs=2,
                                max_model_len=100)) as e:
        assert e.max_model_len == 100 and e.stats()["num_kv_blocks"] == 2 * 7
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLMEngine(EngineConfig(str(tiny_model_dir), device="cpu", max_model_len=10**6))
    with pytest.raises(ValueError, match="KV blocks"):
        LLMEngine(EngineConfig(str(tiny_model_dir), device="cpu", num_kv_blocks=2,
                               max_model_len=100))
    with pytest.raises(ValueError, match="cannot hold one KV block"):
        LLMEngine(EngineConfig(str(tiny_model_dir), device="cpu", cpu_kv_cache_bytes=100))
    with LLMEngine(EngineConfig(str(tiny_model_dir), device="cpu",
                                cpu_kv_cache_bytes=10 * 8192)) as e:  # 8 KiB tiny blocks
        assert e.stats()["num_kv_blocks"] == 10 and e.max_model_len == 160


def test_gpu_budget_arithmetic() -> None:
    from engine.kv_capacity import gpu_kv_budget_bytes

    gib = 1024**3
    # 80 GiB device, 10 GiB in use (weights): 0.9 * 80 - 10 = 62 GiB for KV.
    assert gpu_kv_budget_bytes(70 * gib, 80 * gib, 0.9) == int(72 * gib) - 10 * gib
    assert gpu_kv_budget_bytes(5 * gib, 80 * gib, 0.5) < 0  # already over: no room


def test_add_request_validation(engine: LLMEngine) -> None:
    params = SamplingParams()
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], params)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("a", [5] * 257, params)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("a", [5, engine.vocab_size], params)
    with pytest.raises(ValueError, match="integers"):
        engine.add_request("a", [5, 1.5], params)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("", [5], params)
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request("a", [5], {"temperature": 0})
    engine.add_request("a", [5] * 256, params)  # exactly max_model_len is allowed
    with pytest.raises(ValueError, match="already"):
        engine.add_request("a", [5], params)
    outs = run_to_end(engine)
    assert outs["a"][-1].finish_reason == "length" and len(outs["a"][-1].token_ids) == 1
    assert not engine.has_unfinished_requests()


def test_step_outputs_carry_consistent_deltas(engine: LLMEngine) -> None:
    prompts = random_prompts(4000, [3, 20, 50], seed=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=9, ignore_eos=True,
                                                           stop=["\x00\x01\x02"] if i else None))
    for outs in run_to_end(engine).values():
        final = outs[-1]
        assert final.finished and [o.finished for o in outs].count(True) == 1
        assert sum((o.new_token_ids for o in outs), []) == final.token_ids
        assert "".join(o.new_text for o in outs) == final.text
        for o in outs:
            assert final.text.startswith(o.text)
            assert final.token_ids[: len(o.token_ids)] == o.token_ids
        assert set(final.cached_tokens_by_tier) == set(TIERS)


def test_abort_frees_blocks_and_reports(engine: LLMEngine) -> None:
    a, b = random_prompts(4000, [30, 30], seed=2)
    engine.add_request("a", a, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", b, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("queued", b, SamplingParams(max_tokens=5))
    engine.abort_request("queued")  # still in the inbox
    first_step = {out.request_id: out for out in engine.step()}
    engine.abort_request("a")
    engine.abort_request("unknown")  # ignored
    outs = run_to_end(engine)
    outs["queued"] = [first_step["queued"]]
    assert outs["a"][-1].finish_reason == "abort" and outs["a"][-1].finished
    assert outs["queued"][-1].finish_reason == "abort" and outs["queued"][-1].token_ids == []
    assert outs["b"][-1].finish_reason == "length" and len(outs["b"][-1].token_ids) == 5
    stats = engine.stats()
    assert stats["num_blocks_in_use"] == 0 and stats["num_running"] == 0
    assert stats["num_requests_finished"] == 3
    engine.block_manager.check_integrity()


def test_requests_from_another_thread_while_stepping(engine: LLMEngine) -> None:
    """A serving thread runs step() while this thread adds and aborts requests."""
    finished: dict[str, RequestOutput] = {}
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            if not engine.has_unfinished_requests():
                time.sleep(0.001)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        prompts = random_prompts(4000, [5 + 3 * i for i in range(24)], seed=3)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"t{i}", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
            if i % 5 == 0:
                engine.abort_request(f"t{i}")
        deadline = time.monotonic() + 60
        while len(finished) < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(10)
    assert len(finished) == len(prompts)
    for i in range(len(prompts)):
        reason = finished[f"t{i}"].finish_reason
        assert reason == "length" or (i % 5 == 0 and reason == "abort")
    engine.block_manager.check_integrity()


def test_stats_count_tokens_and_hits(engine: LLMEngine) -> None:
    prompt = random_prompts(4000, [40], seed=4)[0]
    for i in range(2):
        engine.add_request(f"s{i}", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        run_to_end(engine)
    stats = engine.stats()
    assert stats["prompt_tokens_total"] == 80 and stats["generation_tokens_total"] == 6
    assert stats["prefix_cache_queries"] == 80
    assert stats["prefix_cache_hit_tokens"] == {"hbm": 32, "hbm_peer": 0, "dram": 0, "ssd": 0,
                                                 "remote": 0}
    assert stats["num_blocks_cached"] >= 2 and stats["num_waiting"] == 0
    engine.add_request("w", prompt, SamplingParams())
    assert engine.stats()["num_waiting"] == 1


def test_kv_arena_in_shared_memory(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(str(tiny_model_dir), device="cpu", num_kv_blocks=12))
    kv = engine.kv_cache
    # Anonymous shared memory: a memfd, nothing in /dev/shm to open by name.
    fd = kv.layout().fds[0]
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvengine-arena")
    mc = engine.model_config
    assert kv.array.shape == (12, mc.num_layers, 2, 16, mc.num_kv_heads, mc.head_dim)
    assert kv.dtype == "float32"
    layout = KVLayout.from_wire(kv.layout().to_wire())
    region = layout.regions[0]
    assert region.handle == 0 and layout.num_blocks == 12 and layout.fds == ()
    assert region.block_bytes == region.block_stride == kv.array[0].nbytes
    assert region.size_bytes == kv.array.nbytes and layout.meta["layout"] == "block-major"
    # One block is one contiguous run of bytes at block_id * block_bytes.
    kv.array[5] = 1.5
    flat = np.frombuffer(os.pread(fd, kv.size_bytes, 0), dtype=np.float32)
    start, end = (x // 4 for x in region.piece_bounds(5))
    assert (flat[start:end] == 1.5).all() and (flat[:start] == 0).all()
    ns = engine.namespace("t")
    assert ns.model == engine.model_identity and ns.tenant_salt == "t"
    engine.close()
    engine.close()
    with pytest.raises(ValueError):
        _ = kv.memory.fd  # closed with the engine


def test_llm_generate_text_prompts_in_order(tiny_model_dir: Path) -> None:
    with LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64) as llm:
        texts = ["The lighthouse keeper", "Bread is a patient food.", "A"]
        outs = llm.generate(texts, SamplingParams(max_tokens=4, ignore_eos=True))
        assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode(t) for t in texts]
        with pytest.raises(ValueError, match="SamplingParams"):
            llm.generate(texts, [SamplingParams()])
        with pytest.raises(ValueError, match="list"):
            llm.generate("one prompt")  # type: ignore[arg-type]
        assert llm.engine.model_name == tiny_model_dir.name


def test_tokenizer_chat_template_and_eos(tiny_model_dir: Path) -> None:
    with LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=8) as llm:
        tok = llm.tokenizer
        text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Hi!"}])
        assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!"
                        "<|im_end|>\n<|im_start|>assistant\n")
        no_prompt = tok.apply_chat_template([{"role": "user", "content": "x"}],
                                            add_generation_prompt=False)
        assert not no_prompt.endswith("assistant\n")
        im_end = tok.encode("<|im_end|>", add_special_tokens=False)
        assert len(im_end) == 1 and im_end[0] in tok.eos_token_ids
        assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"


def test_chat_template_is_sandboxed(tiny_model_dir: Path, tmp_path: Path) -> None:
    import shutil

    import jinja2

    from engine.tokenizer import Tokenizer

    folder = shutil.copytree(tiny_model_dir, tmp_path / "m")
    (folder / "tokenizer_config.json").write_text(
        '{"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"}')
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_incremental_detokenizer_equals_full_decode(tiny_model_dir: Path) -> None:
    with LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=8) as llm:
        tok = llm.tokenizer
        text = "Grüße aus Köln 🙂 — naïve café, 東京 and ok."
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, None)
        seen = []
        for n in range(1, len(ids) + 1):
            detok.update(ids[:n])
            seen.append(detok.text)
            assert "\ufffd" not in detok.text
        assert detok.text == tok.decode(ids) == text
        assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))


def _memfds() -> set[str]:
    """This process's descriptors of anonymous shared memory."""
    found = set()
    for entry in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(entry).startswith("/memfd:"):
                found.add(entry.name)
    return found


def test_no_shared_memory_left_behind(tiny_model_dir: Path) -> None:
    before_fds = _memfds()
    with LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=8) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        assert _memfds() - before_fds  # the arena
    assert _memfds() <= before_fds


def test_requests_arriving_while_the_device_runs_join_that_step(engine: LLMEngine) -> None:
    """A request added while a step's forward runs (as the server's threads add them) is
    handed to the scheduler before the step waits for the device, so its store lookup
    travels during the step; it runs from the next step on, in order, and an abort of it
    still works. The forward is queued before the hook runs, and the hook runs once a step."""
    prompts = random_prompts(engine.vocab_size, [40, 30, 20], seed=12)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("a", prompts[0], params)
    execute = engine.runner.execute
    calls: list[int] = []

    def arriving_mid_step(batch, while_device_runs=None):
        def hook(device_done, host_waits=True):
            assert device_done()  # the CPU backend ran the forward before returning
            calls.append(len(calls))
            if len(calls) == 1:  # the server adds two requests while the device runs
                engine.add_request("b", prompts[1], params)
                engine.add_request("c", prompts[2], params)
            while_device_runs(device_done, host_waits)
        return execute(batch, while_device_runs=hook)

    engine.runner.execute = arriving_mid_step
    engine.step()
    assert len(calls) == 1
    assert {s.request_id for s in engine.scheduler.waiting} == {"b", "c"}
    assert engine.stats()["num_waiting"] == 2  # none left queued for a later step
    engine.abort_request("c")
    finished: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {"a": "length", "b": "length", "c": "abort"}
    assert len(calls) >= 3  # once per step that ran a batch


def test_the_step_hook_says_whether_the_host_will_wait_for_the_device(tiny_model_dir) -> None:
    """A step of mid-prompt chunks only reads nothing back, so the host does not wait for it
    (and queues the next chunk meanwhile); the step that samples does."""
    with LLMEngine(EngineConfig(str(tiny_model_dir), device="cpu", num_kv_blocks=64,
                                max_num_batched_tokens=64)) as eng:
        eng.add_request("long", random_prompts(eng.vocab_size, [150], seed=13)[0],
                        SamplingParams(max_tokens=2, ignore_eos=True))
        execute = eng.runner.execute
        waits: list[bool] = []
        bases: list = []  # the arrival watch's measure as each step ran

        def noting(batch, while_device_runs=None):
            def hook(device_done, host_waits):
                waits.append(host_waits)
                bases.append(eng.last_waited_step)
                while_device_runs(device_done, host_waits)
            return execute(batch, while_device_runs=hook)

        eng.runner.execute = noting
        run_to_end(eng)
        assert waits == [False, False, True, True]  # chunks of 64, 64, 22 + sample; a decode
        # the watch is measured by steps the host waited for, not by a chunk's launches
        assert bases[:3] == [None, None, None] and bases[3].num_tokens == 22
