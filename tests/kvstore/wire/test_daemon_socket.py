"""The control socket: permissions, stale files, peer uid, malformed frames, a live fuzz."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
from daemon_helpers import (
    REPO_ROOT,
    RunningDaemon,
    is_closed,
    raw_connect,
    recv_message,
    send_message,
)

from kvstore.daemon.server import Daemon
from kvstore.daemon.service import Service
from kvstore.store.tiered import StoreConfig, TieredStore
from kvstore.wire import protocol as proto

pytestmark = pytest.mark.timeout(90)


def test_socket_is_0600_in_a_0700_dir(daemon: RunningDaemon) -> None:
    st = os.stat(daemon.socket_path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(daemon.socket_path.parent).st_mode) == 0o700


def test_creates_missing_socket_dir_0700(make_daemon, tmp_path: Path) -> None:
    running = make_daemon(http=False)
    # start_daemon puts the socket in a fresh mkdtemp dir; ask for a nested, missing one too.
    nested = running.socket_path.parent / "deeper" / "kv.sock"
    running.stop()
    proc = _serve(nested)
    try:
        _wait_for_socket(nested)
        assert stat.S_IMODE(os.stat(nested.parent).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(nested).st_mode) == 0o600
    finally:
        proc.terminate()
        proc.wait(10)


def _serve(socket_path: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--socket",
                             str(socket_path), "--dram", "8MiB", "--http", "off", *extra],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_for_socket(path: Path, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_refuses_a_dir_open_to_others(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    proc = _serve(loose / "kv.sock")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "0755" in err and "group or others" in err
    assert "Traceback" not in err
    assert not (loose / "kv.sock").exists()


def test_refuses_a_dir_owned_by_someone_else(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to make a directory owned by another user")
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.chown(other, 65534, 65534)
    proc = _serve(other / "kv.sock")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "owned by uid 65534" in err


def test_stale_socket_is_replaced_live_one_is_not(make_daemon, tmp_path: Path) -> None:
    running = make_daemon(http=False)
    # A live daemon's socket: a second daemon must refuse it, and leave it alone.
    proc = _serve(running.socket_path)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "already listening" in err
    with running.client() as c:
        assert c.health()["status"] == "ok"
    # A dead daemon's socket (kill -9 leaves the file): the next start replaces it.
    running.kill9()
    sock_dir = Path(os.path.dirname(running.socket_path))
    sock_dir.mkdir(mode=0o700, exist_ok=True)
    leftover = socket.socket(socket.AF_UNIX)
    leftover.bind(str(running.socket_path))
    leftover.close()
    assert running.socket_path.exists()
    proc = _serve(running.socket_path)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with running.client() as c:
                    assert c.health()["status"] == "ok"
                break
            except ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(10)


def test_refuses_to_replace_a_regular_file(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    (d / "kv.sock").write_text("precious")
    proc = _serve(d / "kv.sock")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "not a socket" in err
    assert (d / "kv.sock").read_text() == "precious"


def test_other_uid_is_rejected(tmp_path: Path) -> None:
    # The daemon's own peer check, in-process: allow only a uid that is not ours.
    async def scenario() -> dict:
        store = TieredStore(StoreConfig(dram_bytes=1 << 20))
        daemon = Daemon(Service(store), tmp_path / "s" / "kv.sock",
                        allowed_uids=frozenset({os.getuid() + 4242}))
        task = asyncio.create_task(daemon.serve())
        while not (tmp_path / "s" / "kv.sock").exists():
            await asyncio.sleep(0.01)

        def talk() -> tuple[dict, bool]:
            sock = raw_connect(tmp_path / "s" / "kv.sock")
            with contextlib.suppress(OSError):
                send_message(sock, {"id": 1, "verb": "health"})
            return recv_message(sock), is_closed(sock)

        reply, closed = await asyncio.to_thread(talk)
        daemon.stop()
        await task
        return {"reply": reply, "closed": closed}

    out = asyncio.run(scenario())
    assert out["reply"]["ok"] is False
    assert out["reply"]["error"]["code"] == "permission_denied"
    assert out["closed"]


def test_malformed_frame_closes_only_that_connection(daemon: RunningDaemon) -> None:
    with daemon.client() as good:
        good.put(b"survivor", b"still here")
        bad = raw_connect(daemon.socket_path)
        body = b"\xc1\xc1\xc1"
        bad.sendall(struct.pack("<I", len(body)) + body)
        reply = recv_message(bad)
        assert reply["ok"] is False and reply["error"]["code"] == "malformed_frame"
        assert reply["id"] is None
        assert is_closed(bad)
        # Not a map, and a map without an id: same treatment.
        for obj in ([1, 2, 3], {"verb": "health"}):
            s = raw_connect(daemon.socket_path)
            send_message(s, obj)
            assert recv_message(s)["error"]["code"] == "malformed_frame"
            assert is_closed(s)
        assert good.get(b"survivor") == b"still here"


def test_oversized_length_prefix_rejected(daemon: RunningDaemon) -> None:
    s = raw_connect(daemon.socket_path)
    s.sendall(struct.pack("<I", proto.MAX_FRAME_BYTES + 1))  # and never a body
    reply = recv_message(s)
    assert reply["error"]["code"] == "frame_too_large"
    assert is_closed(s)
    with daemon.client() as c:
        assert c.health()["status"] == "ok"


def test_unknown_verb_and_bad_args_keep_the_connection(daemon: RunningDaemon) -> None:
    s = raw_connect(daemon.socket_path)
    send_message(s, {"id": 11, "verb": "frobnicate", "args": {}})
    reply = recv_message(s)
    assert reply == {"id": 11, "ok": False, "error": reply["error"]}
    assert reply["error"]["code"] == "unknown_verb"
    send_message(s, {"id": 12, "verb": "put", "args": {"key": "text", "value": b"v"}})
    reply = recv_message(s)
    assert reply["id"] == 12 and reply["error"]["code"] == "bad_request"
    assert "key" in reply["error"]["message"]
    send_message(s, {"id": 13, "verb": "lookup", "args": {"namespace": b"x" * 16,
                                                          "hashes": [b"y" * 16], "idents": []}})
    assert recv_message(s)["error"]["code"] == "bad_request"
    send_message(s, {"id": 14, "verb": "health"})
    reply = recv_message(s)
    assert reply["id"] == 14 and reply["ok"] and reply["result"]["status"] == "ok"
    s.close()


def test_truncated_frame_then_disconnect(daemon: RunningDaemon) -> None:
    s = raw_connect(daemon.socket_path)
    s.sendall(struct.pack("<I", 1000) + b"only a little")
    s.close()
    with daemon.client() as c:
        assert c.health()["status"] == "ok"


def test_live_fuzz_daemon_stays_up(daemon: RunningDaemon) -> None:
    rng = random.Random(1234)
    verbs = sorted(proto.SCHEMAS) + ["nope", ""]
    values = [None, True, 0, -1, 2**40, 1.5, "s", b"", b"\x00" * 16, [], [b"\x00" * 16], {},
              {"a": 1}, [1, "x", b"y"]]
    with daemon.client() as watcher:
        for i in range(150):
            s = raw_connect(daemon.socket_path, timeout_s=5)
            kind = rng.random()
            if kind < 0.3:
                blob = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
                s.sendall(blob)
            elif kind < 0.5:
                body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
                s.sendall(struct.pack("<I", len(body)) + body)
            else:
                args = {rng.choice(["namespace", "key", "value", "hashes", "idents", "lease_id",
                                    "block_ids", "registration_id", "layout", "engine_id"]):
                        rng.choice(values) for _ in range(rng.randrange(4))}
                msg = {"id": i, "verb": rng.choice(verbs), "args": args}
                s.sendall(struct.pack("<I", len(b := msgpack.packb(msg))) + b)
            s.settimeout(0.5)
            with contextlib.suppress(TimeoutError, ConnectionError):
                s.recv(65536)
            s.close()
        assert watcher.health()["status"] == "ok"
    assert daemon.proc.poll() is None


def test_concurrent_clients_are_independent(daemon: RunningDaemon) -> None:
    results: list[bool] = []

    def worker(n: int) -> None:
        with daemon.client() as c:
            c.put(f"indep-{n}".encode(), bytes([n]) * 100)
            results.append(c.get(f"indep-{n}".encode()) == bytes([n]) * 100)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [True] * 8
