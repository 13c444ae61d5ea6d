"""vLLM with the kvstore connector, end to end: real vLLM processes (CPU) on a real daemon.

One daemon and three vLLM engines for the module (each start costs ~10 s): ``baseline`` runs
without the connector (the reference logprobs), ``first`` and ``second`` run with it. Each test
uses its own prompts, so what one test stores never answers another's. The killed-daemon and
damaged-SSD tests run last: they restart the daemon on the same socket.
"""

from __future__ import annotations

import signal
import time

import pytest
from daemon_helpers import start_daemon, wait_until
from vllm_parts import BLOCK_SIZE, assert_same_logprobs, engines_up, full_blocks_tokens, prompt
from vllm_parts import dram_blocks as daemon_dram_blocks

from kvstore.testing.vllm_process import VllmProcess

pytestmark = pytest.mark.vllm

LOOKUP_TIMEOUT_S, RETRY_S = 0.5, 1.0
EXTRA = {"lookup_timeout_s": LOOKUP_TIMEOUT_S, "retry_interval_s": RETRY_S,
         "load_timeout_s": 5.0, "save_timeout_s": 5.0}


def _serve(workdir, ssd_dir, socket_path=None):
    return start_daemon(workdir, dram="256MiB", ssd_dir=ssd_dir, ssd_size="256MiB", http=False,
                        socket_path=socket_path)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    ssd_dir = tmp_path_factory.mktemp("vllm-ssd")
    holder = {"daemon": _serve(tmp_path_factory.mktemp("vllm-daemon"), ssd_dir),
              "ssd_dir": ssd_dir}
    yield holder
    holder["daemon"].stop()


@pytest.fixture(scope="module")
def engines(small_model_dir, store):
    sock = store["daemon"].socket_path
    with engines_up({"baseline": VllmProcess(small_model_dir, None, wait=False),
                     "first": VllmProcess(small_model_dir, sock, EXTRA, wait=False),
                     "second": VllmProcess(small_model_dir, sock, EXTRA, wait=False)}) as procs:
        yield procs


def dram_blocks(store) -> int:
    """Blocks in DRAM of the module's daemon (the tests that restart it replace it)."""
    return daemon_dram_blocks(store["daemon"])


def test_second_instance_serves_a_repeated_prompt_from_the_store(engines, store) -> None:
    p = prompt(1)
    want = engines["baseline"].ask(p)
    before = dram_blocks(store)
    first = engines["first"].ask(p)
    assert first["num_cached_tokens"] == 0
    assert_same_logprobs(first, want)
    num_blocks = len(p) // BLOCK_SIZE
    assert wait_until(lambda: dram_blocks(store) >= before + num_blocks, 10.0)
    second = engines["second"].ask(p)
    hit = full_blocks_tokens(len(p))
    assert second["num_cached_tokens"] == hit
    assert second["external_hits"] - 0 >= hit  # vLLM's own external_prefix_cache_hits
    assert_same_logprobs(second, want)
    # The connector's counters reach vLLM's /metrics (vllm:kvstore_events_total{event=...}).
    assert first["store_events"].get("scheduler_blocks_save_planned", 0) >= num_blocks
    assert second["store_events"].get("scheduler_lookup_hits", 0) >= 1
    assert second["store_events"].get("blocks_loaded", 0) >= hit // BLOCK_SIZE


def test_loaded_blocks_are_really_used(engines, store, small_model_dir) -> None:
    """Random bytes stored under exactly the keys vLLM asks for: vLLM takes the hit and its
    answer changes, so a hit's KV is what attention reads (the daemon cannot tell garbage)."""
    torch = pytest.importorskip("torch")
    from offload.external.block_keys import KeyMaker, weights_identity
    from offload.external.kv_tensors import make_mover
    from offload.external.plan import BlockTransfer, StepPlan
    from offload.external.worker_side import WorkerSide
    from offload.vllm.model_identity import vllm_identity

    # What the connector reads from vLLM for this model on CPU (see its log line).
    model = vllm_identity("Qwen3ForCausalLM", 2, 2, 32, "bfloat16", BLOCK_SIZE,
                          weights_identity(str(small_model_dir)), "cpu:LBHNC:kvheads2:head32/32")
    p = prompt(11)
    keys = KeyMaker(model).keys(p)
    num_blocks = keys.num_blocks
    raw = torch.randn(2 * num_blocks * 2 * BLOCK_SIZE * 64, generator=torch.Generator()
                      .manual_seed(0)).to(torch.bfloat16)
    layers = list(raw.view(2, num_blocks, 2, BLOCK_SIZE, 64).unbind(0))
    worker = WorkerSide(store["daemon"].socket_path,
                        make_mover(["l0", "l1"], layers, num_blocks, num_blocks, {}), "forger",
                        5.0, 5.0, retry_interval_s=1.0)
    try:
        assert worker.connect()
        worker.save(StepPlan(saves=[BlockTransfer("g", list(range(num_blocks)),
                                                  keys.namespace, keys.hashes, keys.idents)]))
        worker.drain(10.0)
        assert worker.counters["blocks_saved"] == num_blocks
    finally:
        worker.close()
    want = engines["baseline"].ask(p)
    got = engines["second"].ask(p)
    assert got["num_cached_tokens"] == full_blocks_tokens(len(p))
    assert got["logprobs"] != want["logprobs"]


def test_different_cache_salts_never_share(engines, store) -> None:
    p = prompt(2)
    before = dram_blocks(store)
    engines["first"].ask(p, cache_salt="alice")
    assert wait_until(lambda: dram_blocks(store) >= before + len(p) // BLOCK_SIZE, 10.0)
    hits_before = engines["second"].ask(prompt(99, 64))["external_hits"]
    bob = engines["second"].ask(p, cache_salt="bob")
    assert bob["num_cached_tokens"] == 0 and bob["external_hits"] == hits_before
    alice = engines["second"].ask(p, cache_salt="alice")
    assert alice["num_cached_tokens"] == full_blocks_tokens(len(p))
    assert_same_logprobs(alice, bob)


def test_vllm_and_kvengine_never_get_each_others_blocks(engines, store, small_model_dir) -> None:
    from engine import LLM, SamplingParams

    sock = str(store["daemon"].socket_path)
    kvengine = LLM(str(small_model_dir), device="cpu", kv_offload=True, kv_store_socket=sock,
                   block_size=BLOCK_SIZE)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2)
        p_engine, p_vllm = prompt(3), prompt(4)
        before = dram_blocks(store)
        kvengine.generate([p_engine], params)
        assert wait_until(lambda: dram_blocks(store) >= before + len(p_engine) // BLOCK_SIZE,
                          10.0)
        hits_before = engines["second"].ask(prompt(98, 64))["external_hits"]
        got = engines["second"].ask(p_engine)
        assert got["num_cached_tokens"] == 0 and got["external_hits"] == hits_before
        before = dram_blocks(store)
        engines["first"].ask(p_vllm)
        assert wait_until(lambda: dram_blocks(store) >= before + len(p_vllm) // BLOCK_SIZE, 10.0)
        (out,) = kvengine.generate([p_vllm], params)
        assert out.num_cached_tokens == 0
        assert sum(out.cached_tokens_by_tier.values()) == 0
        (again,) = kvengine.generate([p_engine], params)  # its own blocks do hit (HBM here)
        assert again.num_cached_tokens > 0
    finally:
        kvengine.close()


def _stalled_answer(engines, seed: int) -> tuple[dict, dict]:
    p = prompt(seed)
    want = engines["baseline"].ask(p)
    return engines["first"].ask(p, timeout_s=60.0), want


def test_a_stopped_daemon_means_recompute_within_a_bounded_wait(engines, store) -> None:
    daemon = store["daemon"]
    fresh = engines["first"].ask(prompt(50))  # warm: the cost of a miss, with the store up
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        got, want = _stalled_answer(engines, 5)
        assert_same_logprobs(got, want)
        assert got["num_cached_tokens"] == 0
        # The one lookup that waits out its deadline, plus slack for a shared 2-core machine.
        assert got["elapsed_s"] <= fresh["elapsed_s"] + LOOKUP_TIMEOUT_S + 2.0
        got, want = _stalled_answer(engines, 6)  # found hung by now: no wait at all
        assert_same_logprobs(got, want)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    time.sleep(RETRY_S + 0.2)
    # The first request after the outage reconnects; the worker's registration is sent without
    # waiting (that request's saves are skipped), so the store is used from the next one on.
    engines["first"].ask(prompt(96, 64))
    p = prompt(7)
    engines["first"].ask(p)
    assert wait_until(lambda: dram_blocks(store) >= len(p) // BLOCK_SIZE, 10.0)
    assert engines["second"].ask(p)["num_cached_tokens"] == full_blocks_tokens(len(p))


def test_a_killed_daemon_means_recompute_and_a_new_one_is_used(engines, store,
                                                               tmp_path) -> None:
    daemon = store["daemon"]
    daemon.proc.kill()
    daemon.proc.wait(10)
    got, want = _stalled_answer(engines, 8)
    assert_same_logprobs(got, want)
    start = time.monotonic()
    got, want = _stalled_answer(engines, 9)
    assert_same_logprobs(got, want)
    assert time.monotonic() - start < 30.0
    store["daemon"] = _serve(tmp_path, store["ssd_dir"], daemon.socket_path)
    time.sleep(RETRY_S + 0.2)
    engines["first"].ask(prompt(95, 64))  # reconnects and registers (see the test above)
    p = prompt(10)
    engines["first"].ask(p)
    assert wait_until(lambda: dram_blocks(store) >= len(p) // BLOCK_SIZE, 10.0)
    second = engines["second"].ask(p)
    assert second["num_cached_tokens"] == full_blocks_tokens(len(p))


def test_damaged_ssd_blocks_are_recomputed_never_wrong(engines, store, tmp_path) -> None:
    p = prompt(12)
    want = engines["baseline"].ask(p)
    before = dram_blocks(store)
    engines["first"].ask(p)
    assert wait_until(lambda: dram_blocks(store) >= before + len(p) // BLOCK_SIZE, 10.0)
    daemon = store["daemon"]
    assert daemon.stop() == 0  # SIGTERM writes the DRAM-only blocks to SSD first
    files = list(store["ssd_dir"].glob("data-*.bin"))
    assert files
    for data_file in files:  # flip one byte in every 4 KiB: every stored block is damaged
        with open(data_file, "r+b") as f:
            for offset in range(123, data_file.stat().st_size, 4096):
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0xFF]))
    store["daemon"] = _serve(tmp_path, store["ssd_dir"], daemon.socket_path)
    time.sleep(RETRY_S + 0.2)
    engines["second"].ask(prompt(94, 64))  # reconnects and registers
    got = engines["second"].ask(p)
    assert_same_logprobs(got, want)
    with store["daemon"].client() as c:
        ssd = c.stats()["tiers"]["ssd"]
    # The lookup found the blocks; the load read the first, found it damaged and stopped: vLLM
    # was told every block failed and recomputed them all.
    assert ssd["counters"]["corrupt"] >= 1
    assert got["num_cached_tokens"] == 0
