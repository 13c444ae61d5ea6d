"""`kvstore serve --socket-group GROUP` (issue 38 item 5): the group's processes (vLLM run as
another user) may use the daemon; nobody else may, even through a folder and socket loosened by
hand, since every peer's credentials are checked. Real daemon; the clients are processes under
an unprivileged uid (the system's python3: that uid cannot read this venv), so the test needs
root to start them."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from daemon_helpers import start_daemon

from kvstore import Client
from kvstore.key_filter import key_filter_path

NOBODY, NOGROUP, DAEMON_GROUP = 65534, 65534, 1
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
# Connect and ask for health (one msgpack frame, spelled out: the system's python has no
# msgpack): a refused peer's answer says so, a let-in one's does not.
PROBE = """
import socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("no access"); sys.exit()
frame = b"\\x82\\xa2id\\x01\\xa4verb\\xa6health"
s.settimeout(20.0)
try:
    s.sendall(struct.pack("<I", len(frame)) + frame)
except OSError:
    pass
data = b""
while len(data) < 4 or len(data) < 4 + struct.unpack("<I", data[:4])[0]:
    chunk = s.recv(4096)
    if not chunk:
        break
    data += chunk
print("refused" if b"may not use this daemon" in data else "let in" if data else "closed")
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or SYSTEM_PYTHON is None,
                                reason="needs root (to run clients as another uid) and python3")


def _probe(socket_path: Path, group: int) -> str:
    out = subprocess.run([SYSTEM_PYTHON, "-c", PROBE, str(socket_path)], user=NOBODY,
                         group=group, extra_groups=[], capture_output=True, text=True,
                         timeout=30, cwd="/", env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _socket_path() -> Path:
    parent = Path(tempfile.mkdtemp(prefix="kvs-group-"))
    parent.chmod(0o711)  # the unprivileged uid may pass through to the socket's own folder
    return parent / "run" / "kvstore.sock"


def test_the_group_is_let_in_and_others_are_not(tmp_path: Path) -> None:
    path = _socket_path()
    daemon = start_daemon(tmp_path, "--socket-group", "nogroup", socket_path=path,
                          http=False)
    try:
        folder, sock = os.stat(path.parent), os.stat(path)
        assert stat.S_IMODE(folder.st_mode) == 0o710 and folder.st_gid == NOGROUP
        assert stat.S_IMODE(sock.st_mode) == 0o660 and sock.st_gid == NOGROUP
        keys = os.stat(key_filter_path(path))  # the group's engines read the key filter too
        assert stat.S_IMODE(keys.st_mode) == 0o640 and keys.st_gid == NOGROUP
        assert _probe(path, NOGROUP) == "let in"
        assert _probe(path, DAEMON_GROUP) == "no access"  # the folder stops it
        os.chmod(path.parent, 0o711)  # loosened by hand: the credentials still stop it
        os.chmod(path, 0o666)
        assert _probe(path, DAEMON_GROUP) == "refused"
        with Client(socket_path=path) as own:  # the daemon's own user, as always
            assert own.stats()["tiers"]["dram"]["capacity_bytes"] > 0
    finally:
        daemon.stop()
        shutil.rmtree(path.parent.parent, ignore_errors=True)


def test_without_a_group_only_the_daemons_user(tmp_path: Path) -> None:
    path = _socket_path()
    daemon = start_daemon(tmp_path, socket_path=path, http=False)
    try:
        assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(key_filter_path(path)).st_mode) == 0o600
        assert _probe(path, NOGROUP) == "no access"
        os.chmod(path.parent, 0o711)
        os.chmod(path, 0o666)
        assert _probe(path, NOGROUP) == "refused"
    finally:
        daemon.stop()
        shutil.rmtree(path.parent.parent, ignore_errors=True)


def test_an_unknown_group_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="no such group"):
        start_daemon(tmp_path, "--socket-group", "no-such-group-kv", socket_path=_socket_path(),
                     http=False)
