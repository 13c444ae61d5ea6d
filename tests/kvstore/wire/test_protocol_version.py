"""The protocol version in a connection's first exchange (issue 30 item 8): a client says its
version in a ``hello`` sent ahead of its first request; a client and daemon of one major work
together, another major gets one error naming both versions; an older client that sends no
hello keeps working, as does a newer client with a daemon from before the handshake. A real
daemon; the other major is this client told to claim 2.0."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from daemon_helpers import raw_connect, recv_message, send_message

from kvstore.wire import connection as wire_connection
from kvstore.wire import protocol as proto
from kvstore.wire.client import Client, ProtocolMismatch
from kvstore.wire.fds import send_with_fds
from kvstore.wire.handshake import read_hello


def test_one_major_works_and_the_client_learns_the_daemons_version(daemon) -> None:
    with Client(daemon.socket_path) as c:
        assert c.health()["status"] == "ok"
        assert c.daemon_protocol == proto.PROTOCOL_VERSION


def test_a_client_of_another_major_gets_one_error_naming_both(daemon, monkeypatch) -> None:
    monkeypatch.setattr(proto, "PROTOCOL_VERSION", "2.0")  # this client now speaks 2.0
    with Client(daemon.socket_path) as c, pytest.raises(ProtocolMismatch) as info:
        c.stats()
    message = str(info.value)
    assert "2.0" in message and "1." in message and "upgrade the older one" in message


def test_the_mismatch_is_the_error_even_when_the_next_send_finds_the_socket_closed(
        daemon, monkeypatch) -> None:
    """The hello's answer can come (and the connection close) before the first request is
    written: that write then fails, and it used to report "Broken pipe" (a README test run,
    s21). Here every frame after the hello waits until the answer has been read."""
    monkeypatch.setattr(proto, "PROTOCOL_VERSION", "2.0")
    sent = []

    def late_send(sock, frame, fds):
        if sent:
            time.sleep(0.3)  # the reader thread reads the refusal and shuts the socket
        sent.append(frame)
        return send_with_fds(sock, frame, fds)

    monkeypatch.setattr(wire_connection, "send_with_fds", late_send)
    with Client(daemon.socket_path) as c, pytest.raises(ProtocolMismatch) as info:
        c.stats()
    # Mostly the request goes out (two frames) into a socket the refusal then shut; on a busy
    # machine the refusal may be read before the request is written, which then never is.
    assert len(sent) in (1, 2) and "2.0" in str(info.value)


def test_the_daemon_refuses_another_major_by_name(daemon) -> None:
    sock = raw_connect(daemon.socket_path)
    try:
        send_message(sock, {"id": 1, "verb": "hello", "args": {"protocol": "7.3",
                                                               "client": "tool 9"}})
        reply = recv_message(sock)
        assert reply["error"]["code"] == proto.PROTOCOL_MISMATCH
        text = reply["error"]["message"]
        assert "tool 9" in text and "7.3" in text and proto.PROTOCOL_VERSION in text
        send_message(sock, {"id": 2, "verb": "hello", "args": {"protocol": "one"}})
        assert recv_message(sock)["error"]["code"] == proto.BAD_REQUEST
    finally:
        sock.close()


def test_an_old_client_without_a_hello_keeps_working(daemon) -> None:
    sock = raw_connect(daemon.socket_path)
    try:
        send_message(sock, {"id": 1, "verb": "health", "args": {}})
        assert recv_message(sock)["result"]["status"] == "ok"
    finally:
        sock.close()


@pytest.mark.parametrize(("reply", "version", "fails"), [
    ({"id": 1, "ok": True, "result": {"protocol": "1.9"}}, "1.9", False),
    ({"id": 1, "ok": False, "error": {"code": "unknown_verb", "message": "?"}}, "1.0", False),
    ({"id": 1, "ok": True, "result": {"protocol": "3.0"}}, "3.0", True),
    ({"id": 1, "ok": True, "result": {}}, "", True),
])
def test_reading_the_answer(reply: dict, version: str, fails: bool) -> None:
    theirs, mismatch = read_hello(reply, Path("/run/kvstore.sock"))
    assert theirs == version and (mismatch is not None) == fails
    if fails:
        assert "/run/kvstore.sock" in str(mismatch) and proto.PROTOCOL_VERSION in str(mismatch)


@pytest.mark.parametrize(("version", "verb", "knows"), [
    ("1.4", "lookup_load", True), ("1.9", "lookup_load", True), ("1.3", "lookup_load", False),
    ("1.3", "engines", True), ("1.1", "engines", False), ("2.5", "lookup_load", False),
    (None, "lookup_load", False), (None, "lookup", True), ("1.0", "save", True),
    ("one", "lookup_load", False),
])
def test_a_verb_goes_only_to_a_daemon_whose_minor_has_it(version, verb, knows) -> None:
    assert proto.knows_verb(version, verb) is knows


def test_a_connected_client_knows_the_daemons_verbs(daemon) -> None:
    with Client(daemon.socket_path) as c:
        c.health()  # the hello is answered before the first reply
        assert c.knows_verb("lookup_load") and c.knows_verb("engines")
