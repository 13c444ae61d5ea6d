"""The two rules of ``kvstore.wire.store_state`` with a real client of a real daemon: a wait past
the deadline with nothing heard since it began is hung, one the daemon answered meanwhile only
slow; no open connection is down; a request that ended without its answer is hung (no reply in
time), refused (an error reply) or down (no connection), as the client raises them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvstore.wire.client import Client, ClientError, DaemonUnavailable
from kvstore.wire.replies import ProtocolMismatch, RequestTimeout
from kvstore.wire.store_state import StoreState, failed_state, judge

DEADLINE_S = 0.1


def test_a_silent_wait_past_the_deadline_is_hung_an_answered_one_slow(daemon) -> None:
    with Client(daemon.socket_path) as client:
        began = time.monotonic()
        assert judge(client, [began, None], DEADLINE_S) is StoreState.OK  # not overdue yet
        time.sleep(2 * DEADLINE_S)
        assert client.health()["status"] == "ok"  # a reply heard after the wait began
        assert judge(client, [began], DEADLINE_S) is StoreState.OK  # slow, not hung
        time.sleep(2 * DEADLINE_S)  # now nothing at all for longer than the deadline
        assert judge(client, [began], DEADLINE_S) is StoreState.HUNG
        assert judge(client, [began], DEADLINE_S, connected=False) is StoreState.HUNG
        assert judge(client, [None], DEADLINE_S) is StoreState.OK  # no wait out: nothing due
        assert judge(client, [None], DEADLINE_S, connected=False) is StoreState.DOWN
    assert judge(client, [None], DEADLINE_S) is StoreState.DOWN  # closed
    assert judge(None, [], DEADLINE_S) is StoreState.DOWN
    assert judge(None, [time.monotonic() - 1.0], DEADLINE_S) is StoreState.HUNG


def test_a_failed_request_says_hung_refused_or_down(tmp_path: Path) -> None:
    with pytest.raises(DaemonUnavailable) as nobody:
        Client(tmp_path / "nobody.sock")
    assert failed_state(nobody.value) is StoreState.DOWN
    assert failed_state(ConnectionResetError()) is StoreState.DOWN
    # The client's timeout is a ClientError too: no reply in time wins.
    assert failed_state(RequestTimeout("no reply")) is StoreState.HUNG
    assert failed_state(TimeoutError("the caller's own bound")) is StoreState.HUNG
    assert failed_state(ClientError("unknown_verb", "locate")) is StoreState.REFUSED
    assert failed_state(ProtocolMismatch("2.0 and 1.4")) is StoreState.REFUSED
