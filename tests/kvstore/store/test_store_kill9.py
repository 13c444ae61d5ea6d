"""A store process killed with SIGKILL while writing: a restart serves exactly what was durable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from store_helpers import NS, block_bytes, block_key

BLOCK = 16 * 1024
NUM_DURABLE = 40
NUM_LATER = 300  # the SSD holds 512 blocks: nothing durable is evicted by these

_CHILD = """
import sys
import time
from store_helpers import NS, block_bytes, block_key
from kvstore.store.tiered import StoreConfig, TieredStore

BLOCK = 16 * 1024
store = TieredStore(StoreConfig(dram_bytes=16 * BLOCK, ssd_dir=sys.argv[1],
                                ssd_bytes=512 * BLOCK))
for i in range({num_durable}):  # 2.5x DRAM: the background thread and the writer demote
    h, ident = block_key(i)
    store.put(NS, h, ident, block_bytes(i, BLOCK))
store.flush_to_ssd()  # whatever is still only in DRAM
print("durable", store.stats()["tiers"]["ssd"]["blocks"], flush=True)
for i in range({num_durable}, {num_durable} + {num_later}):  # the kill lands in this IO
    h, ident = block_key(i)
    store.put(NS, h, ident, block_bytes(i, BLOCK))
    if i % 5 == 0:
        store.flush_to_ssd()
print("done", flush=True)
time.sleep(60)
"""


def test_kill_9_then_restart_serves_durable_blocks_byte_exact(make_store, tmp_path):
    here = Path(__file__).resolve().parent  # tests/kvstore/store
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), str(here.parents[2])]))
    ssd_dir = tmp_path / "ssd"
    script = _CHILD.format(num_durable=NUM_DURABLE, num_later=NUM_LATER)
    child = subprocess.Popen([sys.executable, "-c", script, str(ssd_dir)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = child.stdout.readline().split()
        assert line[:1] == ["durable"], child.stderr.read()
        assert int(line[1]) == NUM_DURABLE
        time.sleep(0.1)  # let it write more, unsynchronised with us
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    store = make_store(dram_bytes=16 * BLOCK, ssd_dir=ssd_dir, ssd_bytes=512 * BLOCK)
    ssd = store.stats()["tiers"]["ssd"]
    assert ssd["blocks"] >= NUM_DURABLE
    for i in range(NUM_DURABLE):
        h, ident = block_key(i)
        assert store.get(NS, h, ident) == block_bytes(i, BLOCK), i
    # Blocks written after "durable" may or may not be there; any that is, is exact.
    for i in range(NUM_DURABLE, NUM_DURABLE + NUM_LATER):
        h, ident = block_key(i)
        got = store.get(NS, h, ident)
        assert got is None or got == block_bytes(i, BLOCK), i
    assert store.stats()["tiers"]["ssd"]["counters"]["corrupt"] == 0
    store.check_integrity()
