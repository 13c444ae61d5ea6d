"""A copy request that waited in the socket while the daemon was stopped (SIGSTOP) runs out of
its client's deadline there, not from when the daemon reads it.

The engine gives up on a save at its own deadline and takes its blocks back for new KV; a daemon
that then copies them stores those new bytes under the old keys. A client on the daemon's clock
(the hello says so, protocol 1.3) stamps each request with when it was sent, and the daemon's
deadline runs from then: a save read after it finds its deadline passed and copies nothing."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from daemon_helpers import make_chain
from support.arena import ShmArena

from kvstore.wire import protocol as proto
from kvstore.wire.client import ClientError
from kvstore.wire.handshake import same_clock

pytestmark = pytest.mark.timeout(60)

NUM_BLOCKS = 4
BLOCK_BYTES = 16 * 1024


def test_a_save_read_after_its_senders_deadline_copies_nothing(make_daemon, arenas) -> None:
    daemon = make_daemon(dram="16MiB")
    arena = ShmArena(NUM_BLOCKS, BLOCK_BYTES, seed=3)
    arenas.append(arena)
    chain = make_chain("stopped-save", NUM_BLOCKS)
    computed = [arena.block(i) for i in range(NUM_BLOCKS)]
    with daemon.client(timeout_s=10.0) as engine:
        reg = engine.register(arena.layout, "engine")
        assert engine.clock_shared  # one host, one CLOCK_MONOTONIC
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            pending = engine.save_async(reg, chain.namespace, list(range(NUM_BLOCKS)),
                                        chain.hashes, chain.idents, timeout_s=0.5)
            with pytest.raises(ClientError):  # the engine's wait ends: it gives up
                pending.wait(2.0)
            # ... and reuses its blocks for other KV, as an engine does
            arena.blocks[:] = 0x5A
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        hit = engine.lookup(chain.namespace, chain.hashes, chain.idents)
        assert hit.num_hit == 0, "a save read past its deadline copied the reused blocks"
        # the engine saves again and the store holds what it computed then
        for i, block in enumerate(computed):
            arena.blocks[i] = np.frombuffer(block, dtype=np.uint8)
        saved = engine.save(reg, chain.namespace, list(range(NUM_BLOCKS)), chain.hashes,
                            chain.idents)
        assert saved.outcomes == ["saved"] * NUM_BLOCKS
        assert engine.lookup(chain.namespace, chain.hashes, chain.idents).num_hit == NUM_BLOCKS


def test_the_clock_check_and_the_stamp_are_checked() -> None:
    now = time.monotonic()
    ok = {"ok": True, "result": {"protocol": proto.PROTOCOL_VERSION, "mono": now}}
    assert same_clock(ok, now - 0.001, now + 0.001)
    assert not same_clock(ok, now + 5.0, now + 5.1)  # another clock (a time namespace)
    assert not same_clock({"ok": True, "result": {"protocol": "1.2"}}, now, now)  # older daemon
    base = {"id": 1, "verb": "health", "deadline_ms": 1000}
    assert proto.parse_request(base).sent_mono is None
    assert proto.parse_request({**base, "sent_mono": 12.5}).sent_mono == 12.5
    for bad in ("12", float("nan"), float("inf"), [1]):
        with pytest.raises(proto.ProtocolError):
            proto.parse_request({**base, "sent_mono": bad})
