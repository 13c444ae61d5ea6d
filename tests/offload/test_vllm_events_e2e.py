"""The connector's KV events through vLLM's own event publisher (ZMQ, as Dynamo's and llm-d's
routers subscribe): a real vLLM (CPU) with the connector and ``kv_events_config``, a real
daemon. A prompt's full blocks come out as BlockStored with medium CPU (the daemon's DRAM),
under the same block hashes as vLLM's own GPU-medium events."""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest
from daemon_helpers import wait_until
from vllm_parts import BLOCK_SIZE, dram_blocks, engines_up, prompt, running_daemon

from kvstore.testing.vllm_process import VllmProcess

pytestmark = pytest.mark.vllm


def test_stored_blocks_reach_vllms_event_publisher(small_model_dir, tmp_path) -> None:
    zmq = pytest.importorskip("zmq")
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    # An ipc:// endpoint: vLLM's publisher binds it (a tcp:// one with a host, it connects to).
    ipc_dir = tempfile.mkdtemp(prefix="kve-")  # short: a socket path holds 107 bytes
    endpoint = f"ipc://{ipc_dir}/events"
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    with running_daemon(tmp_path) as daemon:
        proc = VllmProcess(small_model_dir, daemon.socket_path, {"retry_interval_s": 1.0},
                           wait=False, engine_args={"kv_events_config": events_config})
        with engines_up({"vllm": proc}):
            sub = zmq.Context.instance().socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            time.sleep(0.5)  # a SUB socket misses what was published before it joined
            decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
            p = prompt(41)
            num_blocks = len(p) // BLOCK_SIZE
            proc.ask(p)
            assert wait_until(lambda: dram_blocks(daemon) >= num_blocks, 10.0)
            stored: dict[str, list] = {}
            deadline = time.monotonic() + 20.0
            while len(stored.get("CPU", [])) < num_blocks and time.monotonic() < deadline:
                proc.ask(prompt(90 + int(time.monotonic()) % 7, 2 * BLOCK_SIZE))  # steps
                while sub.poll(200):
                    _, _, payload = sub.recv_multipart()
                    for event in decoder.decode(payload).events:
                        if isinstance(event, BlockStored):
                            stored.setdefault(event.medium, []).extend(event.block_hashes)
            sub.close(linger=0)
    shutil.rmtree(ipc_dir, ignore_errors=True)
    cpu = stored.get("CPU", [])
    assert len(cpu) >= num_blocks, stored.keys()
    gpu = stored.get("GPU", [])
    # The prompt's blocks carry vLLM's own hashes: the ones its GPU events named.
    assert set(gpu[:num_blocks]) <= set(cpu), (gpu[:num_blocks], cpu)
