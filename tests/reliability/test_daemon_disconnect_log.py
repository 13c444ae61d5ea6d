"""Issue 32 item 3: disconnects with pipelined requests flooded the daemon's log. A client that
pipelined 63 gets of an 8 MiB value and closed left 62 tasks waiting for the connection's bulk
slot for good (the task that found the connection closed returned without giving its slot
back), each later destroyed with an ERROR "Task was destroyed but it is pending!": 1.1 MB of
log in 23 s. Now every way out of a request gives its slots back, a closing connection's tasks
are cancelled and awaited, and unexpected failures are logged at most once per 10 s per verb.

A real `kvstore serve`; clients that pipeline and go away in several ways, for a few seconds.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from daemon_helpers import RunningDaemon, raw_connect
from reliability_helpers import block_bytes

from kvstore.wire import protocol as proto

VALUE_BYTES = 8 << 20
NUM_PIPELINED = 63
ATTACK_S = 2.5
MAX_LINES_PER_S = 2.0  # "at most a few log lines per second, whatever the clients do"


def _gets(num: int) -> bytes:
    return b"".join(b"".join(proto.encode_frame({
        "id": i, "verb": "get", "deadline_ms": 30_000,
        "args": {"namespace": "default", "key": b"big"}})) for i in range(1, num + 1))


def _close_at_once(sock: socket.socket, frames: bytes) -> None:
    sock.sendall(frames)
    sock.close()


def _close_after_a_little(sock: socket.socket, frames: bytes) -> None:
    sock.sendall(frames)
    sock.recv(1 << 16)  # part of the first value
    sock.close()


def _close_mid_frame(sock: socket.socket, frames: bytes) -> None:
    sock.sendall(frames + frames[:20])  # the last request's header and a little more
    sock.close()


def _reset(sock: socket.socket, frames: bytes) -> None:
    sock.sendall(frames)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


def test_clients_that_pipeline_and_go_away_do_not_flood_the_log(
        make_daemon: Callable[..., RunningDaemon]) -> None:
    daemon = make_daemon(dram="64MiB")
    value = block_bytes(7, VALUE_BYTES)
    with daemon.client() as c:
        c.put(b"big", value)
    num_lines_before = len(daemon.lines)
    frames = _gets(NUM_PIPELINED)
    ways = [_close_at_once, _close_after_a_little, _close_mid_frame, _reset]
    num_connections = 0
    lock = threading.Lock()
    stop_at = time.monotonic() + ATTACK_S

    def attack(way: Callable[[socket.socket, bytes], None]) -> None:
        nonlocal num_connections
        while time.monotonic() < stop_at:
            way(raw_connect(daemon.socket_path), frames)
            with lock:
                num_connections += 1
            time.sleep(0.05)

    started = time.monotonic()
    attackers = [threading.Thread(target=attack, args=(way,)) for way in ways]
    for attacker in attackers:
        attacker.start()
    for attacker in attackers:
        attacker.join()
    time.sleep(1.0)  # the watch collects closed connections' garbage within a tick
    with daemon.client(timeout_s=10.0) as c:  # still serving, the same bytes
        assert c.get(b"big") == value
        assert c.health()["status"] == "ok"
    assert daemon.stop() == 0  # what is still pending at shutdown is logged then
    took_s = time.monotonic() - started
    new_lines = daemon.lines[num_lines_before:]
    print(f"\n{num_connections} connections of {NUM_PIPELINED} pipelined 8 MiB gets closed in "
          f"{len(ways)} ways over {took_s:.1f} s: {len(new_lines)} log lines "
          f"({sum(map(len, new_lines))} bytes): {new_lines[:3]}")
    assert num_connections >= 4 * len(ways)
    assert len(new_lines) <= MAX_LINES_PER_S * took_s, "\n".join(new_lines[:20])

