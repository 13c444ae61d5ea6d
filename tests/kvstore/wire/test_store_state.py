"""StoreState's two rules (``kvstore/wire/store_state.py``) with a real client of a real daemon:
a wait past the deadline with nothing heard since it began is hung, one the daemon answered
meanwhile only slow; no open connection is down; a request that ended without its answer is
hung (no reply in time), refused (an error reply) or down (no connection), as the client raises
them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvstore import StoreState
from kvstore.wire.client import Client, ClientError, DaemonUnavailable
from kvstore.wire.replies import ProtocolMismatch, RequestTimeout

DEADLINE_S = 0.1
OK, DOWN, HUNG, REFUSED = StoreState.OK, StoreState.DOWN, StoreState.HUNG, StoreState.REFUSED


def _state(client: Client | None, *waits: float | None, connected: bool = True) -> StoreState:
    return StoreState.while_waiting(client, waits, DEADLINE_S, connected)


def test_an_answer_unread_because_this_process_was_held_up_is_not_a_hang(daemon) -> None:
    """The daemon answered in time; this process kept the GIL (as a long collection would), so
    the reader thread never read it: the answer waits in the socket, the daemon is not hung."""
    import sys

    with Client(daemon.socket_path) as client:
        client.health()  # connected, hello answered
        switch = sys.getswitchinterval()
        sys.setswitchinterval(5.0)
        try:
            for _ in range(5):  # until the hold began before the reader read the answer
                began = time.monotonic()
                pending = client.health_async()
                end = time.monotonic() + 10 * DEADLINE_S
                while time.monotonic() < end:  # the daemon answers meanwhile; nobody reads
                    pass
                unread = client.last_reply_at < began
                state = _state(client, began)
                if unread:
                    break
                pending.wait(5.0)
        finally:
            sys.setswitchinterval(switch)
        assert unread, "the reader read every answer before the hold began"
        assert state is OK
        assert pending.wait(5.0)["status"] == "ok"


def test_a_silent_wait_past_the_deadline_is_hung_an_answered_one_slow(daemon) -> None:
    with Client(daemon.socket_path) as client:
        began = time.monotonic()
        assert _state(client, began, None) is OK  # not overdue yet
        time.sleep(2 * DEADLINE_S)
        assert client.health()["status"] == "ok"  # a reply heard after the wait began
        assert _state(client, began) is OK  # slow, not hung
        time.sleep(2 * DEADLINE_S)  # now nothing at all for longer than the deadline
        assert _state(client, began) is HUNG
        assert _state(client, began, connected=False) is HUNG
        assert _state(client, None) is OK  # no wait out: nothing is due
        assert _state(client, None, connected=False) is DOWN
    assert _state(client, None) is DOWN  # closed
    assert _state(None) is DOWN
    assert _state(None, time.monotonic() - 1.0) is HUNG


def test_a_failed_request_says_hung_refused_or_down(tmp_path: Path) -> None:
    with pytest.raises(DaemonUnavailable) as nobody:
        Client(tmp_path / "nobody.sock")
    assert StoreState.after_failure(nobody.value) is DOWN
    assert StoreState.after_failure(ConnectionResetError()) is DOWN
    # The client's timeout is a ClientError too: no reply in time wins.
    assert StoreState.after_failure(RequestTimeout("no reply")) is HUNG
    assert StoreState.after_failure(TimeoutError("the caller's own bound")) is HUNG
    assert StoreState.after_failure(ClientError("unknown_verb", "locate")) is REFUSED
    assert StoreState.after_failure(ProtocolMismatch("2.0 and 1.4")) is REFUSED
