"""PeerProcess: the daemon's process seen through its socket, alive or exited (a real process
listening on a Unix socket, killed)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from kvstore.wire.peer_process import PeerProcess

_LISTEN = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1]); s.listen(1); print("up", flush=True)
conn, _ = s.accept(); time.sleep(60)
"""


def test_the_peer_is_watched_until_its_process_exits(tmp_path) -> None:
    path = str(tmp_path / "peer.sock")
    proc = subprocess.Popen([sys.executable, "-c", _LISTEN, path], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            peer = PeerProcess.of_socket(sock)
        assert peer.pid == proc.pid and peer.watched
        assert not peer.exited and not peer.exited  # alive: asked twice, still so
        proc.kill()
        deadline = time.monotonic() + 10.0
        while not peer.exited and time.monotonic() < deadline:
            time.sleep(0.01)
        assert peer.exited  # a zombie not yet reaped has exited too
        proc.wait(10.0)
        assert peer.exited and peer.watched  # stays so
    finally:
        proc.kill()
        proc.wait(10.0)


def test_a_peer_it_cannot_see_is_never_taken_for_exited() -> None:
    """Pid 0 (a daemon in a pid namespace this process cannot see) or a socket with no peer:
    no watch, and ``exited`` stays False (the caller waits as it would without one)."""
    assert not PeerProcess(0).watched and not PeerProcess(0).exited
    a, b = socket.socketpair()
    with a, b:
        assert PeerProcess.of_socket(a).pid > 0  # a socketpair's peer is this very process
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as lone:
        unwatched = PeerProcess.of_socket(lone)
        assert not unwatched.exited
