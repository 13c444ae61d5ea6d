"""File descriptors sent with frames (SCM_RIGHTS): bound to the frame that carried them, bounded,
and never left open in the daemon.

``FdSocket`` is driven over a real socketpair; the rest goes to a real `kvstore serve` through raw
frames: descriptors with a register frame among pipelined others, descriptors in the middle of a
frame, too many at once, descriptors with a verb that takes none. Afterwards the daemon holds no
more descriptors than before.
"""

from __future__ import annotations

import array
import os
import socket

import pytest
from daemon_helpers import (
    RunningDaemon,
    is_closed,
    raw_connect,
    recv_message,
    send_message,
    wait_until,
)
from support.arena import ShmArena

from kvstore.wire import protocol as proto
from kvstore.wire.client import ClientError
from kvstore.wire.fds import MAX_FDS_PER_FRAME, FdError, FdSocket, send_with_fds

BLOCK_BYTES = 4096


def _frame(request_id: int, verb: str, args: dict) -> list[bytes]:
    return proto.encode_frame({"id": request_id, "verb": verb, "args": args})


def _rights(fds: list[int]) -> list[tuple[int, int, bytes]]:
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]


def _num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


# ------------------------------------------------------------------------- FdSocket alone


@pytest.fixture
def pair():
    client, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    server = FdSocket.adopt(server, max_fds=4)
    yield client, server
    server.close_unclaimed()
    client.close()
    server.close()


def _read_all(server: FdSocket, num_bytes: int) -> bytes:
    data = b""
    while len(data) < num_bytes:
        data += server.recv(1 << 16)
    return data


def test_descriptors_belong_to_the_frame_they_started(pair) -> None:
    client, server = pair
    r, w = os.pipe()
    try:
        first = b"".join(_frame(1, "health", {}))
        second = _frame(2, "register", {})
        client.sendall(first)
        send_with_fds(client, second, [r, w])
        total = len(first) + len(b"".join(second))
        assert _read_all(server, total) == first + b"".join(second)
        assert server.claim(0, len(first)).numbers == ()  # the health frame carried none
        got = server.claim(len(first), total)
        assert len(got) == 2
        # They are the daemon's own copies of the same pipe.
        os.write(got.numbers[1], b"x")
        assert os.read(r, 1) == b"x"
        before = _open_fds()
        got.close()
        got.close()  # idempotent
        assert len(before - _open_fds()) == 2
    finally:
        os.close(r)
        os.close(w)


def test_descriptors_in_the_middle_of_a_frame_are_refused_and_closed(pair) -> None:
    client, server = pair
    r, w = os.pipe()
    try:
        frame = b"".join(_frame(1, "register", {}))
        client.sendall(frame[:6])
        assert _read_all(server, 6) == frame[:6]  # read apart: no read holds both parts
        client.sendmsg([frame[6:]], _rights([r]))  # not with the frame's first bytes
        before = _open_fds()
        assert _read_all(server, len(frame) - 6) == frame[6:]
        assert len(_open_fds() - before) == 1  # received
        with pytest.raises(FdError) as info:
            server.claim(0, len(frame))
        assert info.value.code == proto.MALFORMED_FRAME
        assert _open_fds() == before  # closed again
        with pytest.raises(FdError):  # the connection stays refused
            server.claim(len(frame), 2 * len(frame))
    finally:
        os.close(r)
        os.close(w)


def test_a_connection_holds_a_bounded_number_of_descriptors(pair) -> None:
    client, server = pair  # max_fds=4
    r, w = os.pipe()
    try:
        before = _open_fds()
        frames = [_frame(i, "register", {}) for i in range(3)]
        for frame in frames:
            send_with_fds(client, frame, [r, w])
        total = sum(len(b"".join(f)) for f in frames)
        _read_all(server, total)  # 6 descriptors arrived, unclaimed: past the bound of 4
        assert _open_fds() == before  # every one closed
        with pytest.raises(FdError) as info:
            server.claim(0, len(b"".join(frames[0])))
        assert info.value.code == proto.RESOURCE_EXHAUSTED
    finally:
        os.close(r)
        os.close(w)


def test_more_descriptors_than_a_frame_may_carry() -> None:
    client, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    server = FdSocket.adopt(server)
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError):  # the client refuses to send them
            send_with_fds(client, _frame(1, "register", {}), [r] * (MAX_FDS_PER_FRAME + 1))
        before = _open_fds()
        frame = b"".join(_frame(1, "register", {}))
        client.sendmsg([frame], _rights([r] * (MAX_FDS_PER_FRAME + 1)))  # sent anyway
        _read_all(server, len(frame))
        assert _open_fds() == before  # the kernel dropped what did not fit, we closed the rest
        with pytest.raises(FdError) as info:
            server.claim(0, len(frame))
        assert info.value.code == proto.RESOURCE_EXHAUSTED
    finally:
        for fd in (r, w):
            os.close(fd)
        client.close()
        server.close()


# ---------------------------------------------------------------------- a real daemon


def _register_args(arena: ShmArena, engine_id: str) -> dict:
    return {"layout": arena.layout.to_wire(), "engine_id": engine_id}


def test_pipelined_frames_keep_their_descriptors(daemon: RunningDaemon,
                                                 arenas: list[ShmArena]) -> None:
    a, b = ShmArena(4, BLOCK_BYTES, 1), ShmArena(4, BLOCK_BYTES, 2)
    arenas += [a, b]
    pid = daemon.proc.pid
    baseline = _num_fds(pid)
    sock = raw_connect(daemon.socket_path)
    try:
        # health, register a, health, register b, health: one send each, no waiting between.
        send_message(sock, {"id": 1, "verb": "health", "args": {}})
        send_message(sock, {"id": 2, "verb": "register", "args": _register_args(a, "a")},
                     a.layout.fds)
        send_message(sock, {"id": 3, "verb": "health", "args": {}})
        send_message(sock, {"id": 4, "verb": "register", "args": _register_args(b, "b")},
                     b.layout.fds)
        send_message(sock, {"id": 5, "verb": "health", "args": {}})
        replies = {r["id"]: r for r in (recv_message(sock) for _ in range(5))}
        assert all(r["ok"] for r in replies.values()), replies
        reg_a = replies[2]["result"]["registration_id"]
        reg_b = replies[4]["result"]["registration_id"]
        # Each registration maps its own frame's memory: a block saved from a reads a's bytes.
        with daemon.client() as c:
            assert c.stats()["daemon"]["registrations"] >= 2
        send_message(sock, {"id": 6, "verb": "unregister", "args": {"registration_id": reg_a}})
        send_message(sock, {"id": 7, "verb": "unregister", "args": {"registration_id": reg_b}})
        assert recv_message(sock)["ok"] and recv_message(sock)["ok"]
    finally:
        sock.close()
    # The received descriptors were closed once mapped, the mappings with the registrations.
    assert wait_until(lambda: _num_fds(pid) <= baseline, timeout_s=5), (_num_fds(pid), baseline)


def test_descriptors_with_another_verb_are_refused_and_closed(daemon: RunningDaemon) -> None:
    pid = daemon.proc.pid
    baseline = _num_fds(pid)
    r, w = os.pipe()
    sock = raw_connect(daemon.socket_path)
    try:
        send_message(sock, {"id": 1, "verb": "health", "args": {}}, (r, w))
        reply = recv_message(sock)
        assert not reply["ok"] and reply["error"]["code"] == "bad_request"
        assert "only ['register']" in reply["error"]["message"]
        send_message(sock, {"id": 2, "verb": "health", "args": {}})  # the connection goes on
        assert recv_message(sock)["ok"]
        assert _num_fds(pid) <= baseline + 1  # the connection's socket, nothing else
    finally:
        sock.close()
        os.close(r)
        os.close(w)


def test_descriptors_not_with_a_frame_start_close_the_connection(daemon: RunningDaemon) -> None:
    pid = daemon.proc.pid
    baseline = _num_fds(pid)
    r, w = os.pipe()
    sock = raw_connect(daemon.socket_path)
    try:
        frame = b"".join(_frame(2, "health", {}))
        # A whole frame and the next one's first bytes in one send: once the first is
        # answered, the daemon has read those bytes too (they came in the same read).
        sock.sendall(b"".join(_frame(1, "health", {})) + frame[:5])
        assert recv_message(sock)["id"] == 1
        sock.sendmsg([frame[5:]], _rights([r, w]))  # descriptors in the middle of frame 2
        reply = recv_message(sock)
        assert reply["id"] is None and reply["error"]["code"] == proto.MALFORMED_FRAME
        assert "first bytes of their frame" in reply["error"]["message"]
        assert is_closed(sock)
    finally:
        sock.close()
        os.close(r)
        os.close(w)
    assert wait_until(lambda: _num_fds(pid) <= baseline, timeout_s=5)
    with daemon.client() as c:
        assert c.health()["status"] == "ok"


def test_a_register_frame_that_carries_too_few_descriptors(daemon: RunningDaemon,
                                                           arenas: list[ShmArena]) -> None:
    arena = ShmArena(4, BLOCK_BYTES, 3, generations=True)  # two descriptors: memory, generations
    arenas.append(arena)
    pid = daemon.proc.pid
    baseline = _num_fds(pid)
    sock = raw_connect(daemon.socket_path)
    try:
        send_message(sock, {"id": 1, "verb": "register",
                            "args": _register_args(arena, "short")}, arena.layout.fds[:1])
        reply = recv_message(sock)
        assert not reply["ok"] and reply["error"]["code"] == "bad_request"
        assert "names file descriptor 1; the register frame carried 1" in \
            reply["error"]["message"]
        send_message(sock, {"id": 2, "verb": "register", "args": _register_args(arena, "whole")},
                     arena.layout.fds)
        assert recv_message(sock)["ok"]  # nothing of the refused one is held
    finally:
        sock.close()
    assert wait_until(lambda: _num_fds(pid) <= baseline, timeout_s=5)


def test_the_client_sends_the_layouts_descriptors(daemon: RunningDaemon,
                                                  arenas: list[ShmArena]) -> None:
    arena = ShmArena(4, BLOCK_BYTES, 4)
    arenas.append(arena)
    with daemon.client() as c:
        reg = c.register(arena.layout, "client")  # KVLayout.fds, sent with the frame
        assert c.unregister(reg)
        # Explicit descriptors replace the layout's: none here, so the region names nothing.
        with pytest.raises(ClientError) as info:
            c.register(arena.layout, "client", fds=[])
        assert "carried 0" in str(info.value)
