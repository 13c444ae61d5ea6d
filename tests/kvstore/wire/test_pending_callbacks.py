"""``Pending.add_done_callback`` with a real daemon: a waiter that is woken by the reply itself
(the router's event loop), not by a thread parked in ``wait()``.

Each callback runs exactly once: on the client's reader thread as the reply lands, at once when
added after it landed, with the failure when the connection goes; one that raises is logged and
the connection keeps dispatching the other replies.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import pytest
from daemon_helpers import RunningDaemon, make_chain

from kvstore.wire.client import DaemonUnavailable, Pending

pytestmark = pytest.mark.timeout(60)


class Landed:
    """The calls a callback got: the handle and the thread each came on."""

    def __init__(self) -> None:
        self.calls: list[tuple[Pending, str]] = []
        self.event = threading.Event()

    def __call__(self, pending: Pending) -> None:
        self.calls.append((pending, threading.current_thread().name))
        self.event.set()


def test_a_callback_runs_once_on_the_reader_thread(daemon: RunningDaemon) -> None:
    chain = make_chain("pending-callbacks", 4, seed=3)
    with daemon.client() as c:
        pending = c.locate_async(chain.namespace, chain.hashes, chain.idents)
        landed = Landed()
        pending.add_done_callback(landed)
        assert landed.event.wait(10)
        reply = pending.wait(0)
        assert reply.num_blocks == 4
        (call,) = landed.calls
        # Either the reader thread, or this one when the reply had landed before the add.
        assert call[0] is pending
        assert call[1] in ("kvstore-client-reader", threading.current_thread().name)
        late = Landed()
        pending.add_done_callback(late)  # landed already: called here and now
        assert late.calls == [(pending, threading.current_thread().name)]
        assert len(landed.calls) == 1


def test_a_lost_connection_lands_its_failure(daemon: RunningDaemon) -> None:
    chain = make_chain("pending-callbacks-lost", 4, seed=4)
    c = daemon.client()
    c.stats()  # connected and greeted before the daemon stops
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        pending = c.locate_async(chain.namespace, chain.hashes, chain.idents)
        landed = Landed()
        pending.add_done_callback(landed)
        assert not landed.event.wait(0.2)  # no answer from a stopped daemon
        c.close()
        assert landed.event.wait(10)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert [p for p, _ in landed.calls] == [pending]
    with pytest.raises(DaemonUnavailable):
        pending.wait(0)


def test_a_raising_callback_is_logged_and_the_connection_goes_on(
        daemon: RunningDaemon, caplog: pytest.LogCaptureFixture) -> None:
    chain = make_chain("pending-callbacks-raise", 4, seed=5)

    def broken(_: Pending) -> None:
        raise RuntimeError("a broken callback")

    with daemon.client() as c, caplog.at_level(logging.ERROR, logger="kvstore.client"):
        first = c.locate_async(chain.namespace, chain.hashes, chain.idents)
        first.add_done_callback(broken)
        second = c.locate_async(chain.namespace, chain.hashes, chain.idents)
        landed = Landed()
        second.add_done_callback(landed)
        assert landed.event.wait(10)
        assert first.wait(5).num_blocks == second.wait(0).num_blocks == 4
        assert c.stats()  # still dispatching
    assert "a done callback of locate" in caplog.text
