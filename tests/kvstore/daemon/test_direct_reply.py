"""A worker writes its call's reply itself (``daemon/direct_reply.py``): through a real daemon,
every reply arrives once and whole, whichever thread wrote it, and a call past its deadline is
answered once, by the loop."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from daemon_helpers import RunningDaemon, raw_connect, recv_message, send_message

from kvstore.wire import protocol as proto

pytestmark = pytest.mark.timeout(90)

VALUE_BYTES = 64 * 1024  # a get's reply: 40 of them fill the socket while nobody reads


def _events(daemon: RunningDaemon) -> dict[str, int]:
    with daemon.client() as c:
        return c.stats()["daemon"]["events"]


def _value(i: int) -> bytes:
    return bytes([i % 251]) * VALUE_BYTES


def test_replies_from_workers_and_the_loop_never_interleave(
        make_daemon: Callable[..., RunningDaemon]) -> None:
    """Puts (a worker writes the reply), healths (the loop answers) and gets of 64 KiB (the
    loop writes the value) on one connection, sent by one thread while another reads with
    pauses: the socket keeps filling and draining, so a worker often finds the transport
    holding part of a value. Every reply still parses, answers its own request, and comes
    once."""
    daemon = make_daemon(dram="64MiB")
    with daemon.client() as c:
        for i in range(8):
            c.put(b"value-%d" % i, _value(i))
    num_requests = 3000
    expected = {rid: ("put", "health", "get")[rid % 3] for rid in range(1, num_requests + 1)}
    sock = raw_connect(daemon.socket_path, timeout_s=30)
    failures: list[BaseException] = []

    def send_all() -> None:
        try:
            for rid, kind in expected.items():
                args = {"key": b"value-%d" % (rid % 8)} if kind == "get" else {}
                if kind == "put":
                    args = {"key": b"small-%d" % (rid % 100), "value": b"x" * 32}
                send_message(sock, {"id": rid, "verb": kind, "args": args})
        except BaseException as exc:  # seen by the reader's assertion below
            failures.append(exc)

    sender = threading.Thread(target=send_all, daemon=True)
    sender.start()
    seen: set[int] = set()
    try:
        while len(seen) < num_requests:
            reply = recv_message(sock)
            assert reply is not None, f"the daemon closed after {len(seen)} replies"
            rid = reply["id"]
            assert rid in expected and rid not in seen, f"reply {rid} unexpected or twice"
            seen.add(rid)
            assert reply["ok"], reply
            if expected[rid] == "get":
                assert reply["result"]["value"] == _value(rid % 8)
            elif expected[rid] == "health":
                assert reply["result"]["status"] in ("ok", "degraded")
            if len(seen) % 40 == 0:
                time.sleep(0.002)  # the socket fills meanwhile
    finally:
        sender.join(timeout=30)
        sock.close()
    assert not failures, failures
    events = _events(daemon)
    assert events["replies_from_worker"] > 0  # the direct path ran
    assert events["replies_handed_to_loop"] > 0  # and gave way while the socket was full


def test_a_call_past_its_deadline_is_answered_once(
        make_daemon: Callable[..., RunningDaemon]) -> None:
    """A 48 MiB put cannot finish in 1 ms: the loop answers deadline_exceeded; the worker that
    finishes the copy later writes nothing, so the next reply is the next request's."""
    daemon = make_daemon(dram="128MiB")
    sock = raw_connect(daemon.socket_path, timeout_s=30)
    try:
        send_message(sock, {"id": 7, "verb": "put", "deadline_ms": 1,
                            "args": {"key": b"big", "value": bytes(48 << 20)}})
        reply = recv_message(sock)
        assert reply["id"] == 7 and not reply["ok"]
        assert reply["error"]["code"] == proto.DEADLINE_EXCEEDED
        time.sleep(1.0)  # the copy finishes meanwhile
        send_message(sock, {"id": 8, "verb": "put", "args": {"key": b"small", "value": b"x"}})
        reply = recv_message(sock)
        assert reply["id"] == 8 and reply["ok"], reply
    finally:
        sock.close()
    assert _events(daemon)["replies_from_worker"] >= 1  # id 8's


def test_replies_via_loop_turns_the_direct_path_off(
        make_daemon: Callable[..., RunningDaemon]) -> None:
    daemon = make_daemon("--replies-via-loop")
    with daemon.client() as c:
        for i in range(20):
            c.put(b"k-%d" % i, b"v")
            assert c.get(b"k-%d" % i) == b"v"
    events = _events(daemon)
    assert events["replies_from_worker"] == 0
    assert events["replies_handed_to_loop"] == 0
