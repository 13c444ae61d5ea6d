"""GPU: the vLLM connector's data path with torch CUDA tensors in vLLM's flash-attention layout.

Each layer is a ``[2, num_blocks, block_size, kv_heads, head_dim]`` CUDA tensor, registered with
a real daemon through CUDA IPC (one K and one V region per layer, read from the tensor's strides).
One "instance" saves blocks through the connector's core (``WorkerSide``/``SchedulerSide``), a
second loads them into other block ids: the bytes must be equal, and untouched blocks stay zero.
vLLM itself cannot be installed on the GPU machine; the CPU end-to-end tests cover vLLM's side.
"""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest
from daemon_helpers import start_daemon

from offload.external.block_keys import KeyMaker
from offload.external.kv_tensors import make_mover
from offload.external.worker_side import WorkerSide
from offload.store_client import StoreClient
from offload.vllm.model_identity import vllm_identity
from offload.vllm.scheduler_side import ScheduledRequest, SchedulerSide

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch has no CUDA here", allow_module_level=True)

LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 96, 16, 8, 128
MODEL = vllm_identity("Qwen3ForCausalLM", LAYERS, HEADS, HEAD_DIM, "bfloat16", BLOCK_SIZE,
                      "gpu-test", "cuda:LBNHC:kvheads8:head128/128")


def _layers(seed: int | None, heads_major: bool = False) -> list:
    out = []
    for i in range(LAYERS):
        if heads_major:  # physically [2, B, H, N, D]; vLLM's logical view [2, B, N, H, D]
            t = torch.zeros(2, NUM_BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM, dtype=torch.bfloat16,
                            device="cuda").transpose(2, 3)
        else:
            t = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, dtype=torch.bfloat16,
                            device="cuda")
        if seed is not None:
            g = torch.Generator(device="cuda").manual_seed(seed * 100 + i)
            t.copy_(torch.randn(t.shape, generator=g, device="cuda", dtype=torch.float32))
        out.append(t)
    torch.cuda.synchronize()
    return out


def _instance(socket_path, layers, staging_slots: int = 0):
    mover = make_mover([f"l{i}" for i in range(LAYERS)], layers, NUM_BLOCKS, 1, {},
                       device_staging_slots=staging_slots)
    worker = WorkerSide(socket_path, mover, "vllm-gpu-test", 30.0, 30.0, retry_interval_s=1.0)
    # The daemon's first CUDA registration sets up its copier: allow it time.
    assert worker.connect(wait_s=60.0), "could not register the CUDA tensors with the daemon"
    scheduler = SchedulerSide(KeyMaker(MODEL), StoreClient(socket_path, None, "sched", 30.0),
                              256, 5.0)
    return scheduler, worker


def _block(layers, block_id: int) -> list:
    return [t[:, block_id].contiguous() for t in layers]


STAGING_SLOTS = 48  # device staging: room for one 40-block save or load


@pytest.mark.parametrize(("heads_major", "a_staged", "b_staged"), [
    (False, False, False), (True, False, False), (False, True, True), (True, True, True),
    (False, True, False), (False, False, True)],
    ids=["NHD", "HND", "NHD-staged", "HND-staged", "NHD-staged-save-direct-load",
         "NHD-direct-save-staged-load"])
def test_flash_layout_save_and_load_are_byte_exact(tmp_path, heads_major: bool, a_staged: bool,
                                                   b_staged: bool) -> None:
    """Saved by one instance, loaded by another, whichever way each moves its blocks (the
    daemon reading the pieces in place, or the worker packing them in device staging): a
    block's bytes are the same either way."""
    daemon = start_daemon(tmp_path, dram="512MiB", http=False)
    try:
        a_layers, b_layers = _layers(1, heads_major), _layers(None, heads_major)
        a_sched, a_worker = _instance(daemon.socket_path, a_layers,
                                      STAGING_SLOTS if a_staged else 0)
        num_blocks = 40
        tokens = [random.Random(3).randrange(10, 5000) for _ in range(num_blocks * BLOCK_SIZE + 1)]
        a_ids = random.Random(1).sample(range(NUM_BLOCKS), num_blocks + 1)
        b_ids = random.Random(2).sample(range(NUM_BLOCKS), num_blocks + 1)
        a_sched.match("r", tokens, 0, None, None)
        a_sched.after_alloc("r", a_ids, 0)
        torch.cuda.synchronize()  # the blocks are written before the daemon reads them
        a_worker.save(a_sched.plan_step([ScheduledRequest("r", 0, len(tokens), None)]))
        a_worker.drain(30.0)  # saves are never waited for by save() itself
        assert a_worker.counters["blocks_saved"] == num_blocks, a_worker.counters
        # The first instance goes before the second registers: torch's allocator may have put
        # both instances' tensors in one cudaMalloc segment, and a CUDA IPC handle is registered
        # once while its registration lives (possession, issue 32).
        a_worker.close()
        b_sched, b_worker = _instance(daemon.socket_path, b_layers,
                                      STAGING_SLOTS if b_staged else 0)

        n = b_sched.match("r", tokens, 0, None, None)
        assert n == num_blocks * BLOCK_SIZE
        b_sched.after_alloc("r", b_ids, n)
        b_worker.start(b_sched.plan_step([]))
        deadline = time.monotonic() + 30.0
        failed: set[int] = set()
        done: set[str] = set()
        while not done and time.monotonic() < deadline:
            done, bad = b_worker.poll()
            failed |= bad
        assert done == {"r"} and not failed
        torch.cuda.synchronize()
        for a_id, b_id in zip(a_ids[:num_blocks], b_ids[:num_blocks]):
            for got, want in zip(_block(b_layers, b_id), _block(a_layers, a_id)):
                assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        untouched = sorted(set(range(NUM_BLOCKS)) - set(b_ids[:num_blocks]))
        for t in b_layers:
            assert not bool((t[:, untouched].view(torch.int16) != 0).any())
        for worker in (a_worker, b_worker):  # every slot lent came back
            staging = getattr(worker.mover, "staging", None)
            if staging is not None:
                deadline = time.monotonic() + 5.0
                while staging.num_free < STAGING_SLOTS and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert staging.num_free == STAGING_SLOTS
        a_worker.close()
        b_worker.close()
    finally:
        daemon.stop()


@pytest.mark.timeout(120)
def test_device_staging_slots_of_a_save_without_a_reply_come_back_after_a_reconnect(
        tmp_path) -> None:
    """A staged save sent to a stopped daemon runs out of time with no reply: its slots stay
    out of use (the daemon may still read them) until the worker's next registration of the
    buffer is accepted, then come back, and the next save goes through them. They used to be
    lost for the process's life, the saves' room shrinking with each such loss."""
    daemon = start_daemon(tmp_path, dram="512MiB", http=False)
    try:
        layers = _layers(4)
        mover = make_mover([f"l{i}" for i in range(LAYERS)], layers, NUM_BLOCKS, 1, {},
                           device_staging_slots=STAGING_SLOTS)
        worker = WorkerSide(daemon.socket_path, mover, "vllm-gpu-lost", 1.0, 1.0,
                            retry_interval_s=0.5)
        assert worker.connect(wait_s=60.0)
        sched = SchedulerSide(KeyMaker(MODEL), StoreClient(daemon.socket_path, None, "sched",
                                                           30.0), 256, 5.0)
        staging = mover.staging
        epoch = worker.client.registration_epoch

        def save(name: str, seed: int, num_blocks: int = 8) -> None:
            rng = random.Random(seed)
            tokens = [rng.randrange(10, 5000) for _ in range(num_blocks * BLOCK_SIZE + 1)]
            sched.match(name, tokens, 0, None, None)
            sched.after_alloc(name, rng.sample(range(NUM_BLOCKS), num_blocks + 1), 0)
            torch.cuda.synchronize()
            worker.save(sched.plan_step([ScheduledRequest(name, 0, len(tokens), None)]))

        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            save("lost", 5)
            deadline = time.monotonic() + 20.0
            while (worker.counters["blocks_quarantined_until_reconnect"] < 8
                   and time.monotonic() < deadline):
                worker.poll()
                time.sleep(0.01)
            assert worker.counters["blocks_quarantined_until_reconnect"] == 8, worker.counters
            assert staging.num_free == STAGING_SLOTS - 8
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30.0
        while staging.num_free < STAGING_SLOTS and time.monotonic() < deadline:
            worker.poll()
            time.sleep(0.01)
        assert staging.num_free == STAGING_SLOTS and mover._save_slots == 0
        assert worker.client.registration_epoch > epoch
        assert worker.counters["blocks_quarantine_released_after_reconnect"] == 8
        save("after", 6)
        worker.drain(30.0)
        assert worker.counters["blocks_saved"] == 8, worker.counters
        worker.close()
    finally:
        daemon.stop()


@pytest.mark.timeout(300)
def test_two_engines_save_at_once_through_default_staging_at_a_users_size(tmp_path) -> None:
    """Two vLLM instances of the Qwen3-4B shape (36 layers, 2.36 MB blocks), each with the
    connector's default device staging (128 slots, 64 for saves, requests of 32), save a
    4,096-token prompt (256 blocks) at once, from their own threads, into one daemon: the
    saves beyond the room wait for it instead of being skipped, and a third instance (pieces
    moved in place) loads every block byte-exact."""
    from offload.external.device_staging import packing_unavailable
    from offload.vllm.settings import ConnectorSettings
    from offload.vllm.staging_room import StagingRoom

    layers, heads, num_blocks, saved = 36, 8, 272, 256
    model = vllm_identity("Qwen3ForCausalLM", layers, heads, HEAD_DIM, "bfloat16", BLOCK_SIZE,
                          "gpu-test-4b", "cuda:LBNHC:kvheads8:head128/128")
    block_bytes = layers * 2 * BLOCK_SIZE * heads * HEAD_DIM * 2
    room = StagingRoom.of(ConnectorSettings(), True, True, True, block_bytes, packing_unavailable)
    assert (room.device_slots, room.save_slots) == (128, 64)

    def kv(seed: int | None) -> list:
        out = [torch.zeros(2, num_blocks, BLOCK_SIZE, heads, HEAD_DIM, dtype=torch.bfloat16,
                           device="cuda") for _ in range(layers)]
        if seed is not None:
            g = torch.Generator(device="cuda").manual_seed(seed)
            for t in out:
                t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
        torch.cuda.synchronize()
        return out

    def instance(name: str, tensors: list, staged: bool):
        mover = make_mover([f"l{i}" for i in range(layers)], tensors, num_blocks,
                           room.num_slots, {}, device_staging_slots=room.device_slots
                           if staged else 0, save_slots=room.save_slots)
        worker = WorkerSide(daemon.socket_path, mover, name, 60.0, 60.0, retry_interval_s=1.0)
        assert worker.connect(wait_s=60.0), "could not register with the daemon"
        sched = SchedulerSide(KeyMaker(model), StoreClient(daemon.socket_path, None,
                                                           f"{name}-sched", 30.0), saved, 5.0)
        return sched, worker

    daemon = start_daemon(tmp_path, dram="2GiB", http=False)
    try:
        prompts = {name: [random.Random(seed).randrange(10, 5000)
                          for _ in range(saved * BLOCK_SIZE + 1)]
                   for name, seed in (("a", 11), ("b", 12))}
        ids = {name: random.Random(seed).sample(range(num_blocks), saved + 1)
               for name, seed in (("a", 21), ("b", 22))}
        tensors = {"a": kv(1), "b": kv(2)}
        engines = {name: instance(f"vllm-gpu-{name}", tensors[name], staged=True)
                   for name in ("a", "b")}
        errors: list[BaseException] = []

        def save(name: str) -> None:
            try:
                sched, worker = engines[name]
                sched.match("r", prompts[name], 0, None, None)
                sched.after_alloc("r", ids[name], 0)
                worker.save(sched.plan_step([ScheduledRequest("r", 0, saved * BLOCK_SIZE + 1,
                                                              None)]))
                worker.drain(120.0)
            except BaseException as exc:  # reported below, on the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=save, args=(name,)) for name in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180.0)
        assert not errors, errors
        for name, (_, worker) in engines.items():
            c = worker.counters
            assert c["blocks_saved"] == saved, (name, c)
            assert c["saves_waited_for_room"] > 0, (name, c)  # 8 requests, room for 2
            assert not any(c[k] for k in c if k.startswith(("blocks_save_dropped",
                                                            "blocks_save_skipped"))), c
            assert worker.mover.staging.num_free == room.device_slots
            worker.close()
        loader_kv = kv(None)
        sched, worker = instance("vllm-gpu-loader", loader_kv, staged=False)
        for name, seed in (("a", 31), ("b", 32)):
            into = random.Random(seed).sample(range(num_blocks), saved + 1)
            assert sched.match(name, prompts[name], 0, None, None) == saved * BLOCK_SIZE
            sched.after_alloc(name, into, saved * BLOCK_SIZE)
            worker.start(sched.plan_step([]))
            deadline, done, failed = time.monotonic() + 60.0, set(), set()
            while name not in done and time.monotonic() < deadline:
                got, bad = worker.poll()
                done |= got
                failed |= bad
            assert name in done and not failed
            sched.loads_finished({name})
            torch.cuda.synchronize()
            src, dst = torch.tensor(ids[name][:saved]), torch.tensor(into[:saved])
            for want, got in zip(tensors[name], loader_kv):
                assert torch.equal(got[:, dst.cuda()].view(torch.int16),
                                   want[:, src.cuda()].view(torch.int16)), name
        worker.close()
    finally:
        daemon.stop()
