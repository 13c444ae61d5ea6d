"""``Client.request_nowait`` with a real daemon: what a router's event loop sends without ever
blocking. A frame goes out only as far as the socket takes it at once; the rest of a frame it
took in part is handed to another thread; nothing is sent (None) before the hello, while
another send holds the socket, or while the socket is full. Replies land as for any request."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from daemon_helpers import RunningDaemon, make_chain

pytestmark = pytest.mark.timeout(60)


def test_nothing_goes_before_the_hello_then_replies_land(daemon: RunningDaemon) -> None:
    chain = make_chain("nowait", 8, seed=5)
    with daemon.client() as c, ThreadPoolExecutor(1) as pool:
        assert c.locate_nowait(chain.namespace, chain.hashes, chain.idents, 5.0,
                               pool.submit) is None  # the hello is not out yet
        assert c.health()["status"] in ("ok", "degraded")
        pending = c.locate_nowait(chain.namespace, chain.hashes, chain.idents, 5.0, pool.submit)
        assert pending is not None
        reply = pending.wait(5.0)
        assert reply.num_blocks == 8 and reply.num_stored == 0


def test_a_stopped_daemon_never_blocks_the_caller(daemon: RunningDaemon) -> None:
    """With the daemon stopped the socket fills: each call returns at once, the last frames
    partly sent go on from the pool's thread, and every request is answered after it goes
    on."""
    chain = make_chain("nowait-full", 4000, seed=6)  # ~400 KB a frame: a few fill the socket
    with daemon.client() as c, ThreadPoolExecutor(4) as pool:
        c.health()
        sent, longest = [], 0.0
        handed = threading.Event()

        def finish(job):
            handed.set()
            return pool.submit(job)

        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(40):
                started = time.monotonic()
                pending = c.locate_nowait(chain.namespace, chain.hashes[:4096],
                                          chain.idents[:4096], 30.0, finish)
                longest = max(longest, time.monotonic() - started)
                if pending is None:
                    break
                sent.append(pending)
            else:
                pytest.fail("40 frames of ~400 KB never filled the socket")
            assert longest < 0.1, f"a call blocked for {longest:.3f} s"
            assert handed.is_set()  # the frame that filled it went on from another thread
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        for pending in sent:
            assert pending.wait(20.0).num_blocks == 4000
