"""The bytes API through a real daemon: put/get byte-exact, misses, namespaces, handles."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from daemon_helpers import RunningDaemon, random_bytes, raw_connect, recv_message, send_message

from kvstore import Client
from kvstore.wire import protocol as proto
from kvstore.wire.client import ClientError, DaemonUnavailable, LookupReply

pytestmark = pytest.mark.timeout(60)


def test_put_get_bytes_exact(daemon: RunningDaemon) -> None:
    with daemon.client() as c:
        for i, size in enumerate([0, 1, 17, 4096, 4097, 1 << 20]):
            value = random_bytes(size, seed=i)
            c.put(f"bytes-{i}".encode(), value)
            assert c.get(f"bytes-{i}".encode()) == value


def test_put_memoryview_and_numpy(daemon: RunningDaemon) -> None:
    arr = np.random.default_rng(1).standard_normal((64, 33)).astype(np.float32)
    strided = np.random.default_rng(2).integers(0, 1000, (40, 40), dtype=np.int64)[::3, 1::2]
    with daemon.client() as c:
        c.put(b"np-array", arr)
        assert c.get(b"np-array") == arr.tobytes()
        c.put(b"np-strided", strided)  # not contiguous: sent in C order
        assert c.get(b"np-strided") == strided.tobytes()
        data = bytearray(random_bytes(1000, seed=3))
        c.put(b"memoryview", memoryview(data)[100:900])
        assert c.get(b"memoryview") == bytes(data[100:900])
        back = np.frombuffer(c.get(b"np-array"), dtype=np.float32).reshape(64, 33)
        np.testing.assert_array_equal(back, arr)


def test_get_missing_is_none(daemon: RunningDaemon) -> None:
    with daemon.client() as c:
        assert c.get(b"never-put") is None
        assert c.get(b"") is None


def test_namespaces_isolate(daemon: RunningDaemon) -> None:
    with daemon.client() as c:
        c.put(b"shared-key", b"tenant-a", namespace="a")
        c.put(b"shared-key", b"tenant-b", namespace="b")
        assert c.get(b"shared-key", namespace="a") == b"tenant-a"
        assert c.get(b"shared-key", namespace="b") == b"tenant-b"
        assert c.get(b"shared-key") is None  # the default namespace never saw it
        assert c.get(b"shared-key", namespace="c") is None


def test_put_twice_replaces(daemon: RunningDaemon) -> None:
    with daemon.client() as c:
        assert c.put(b"dup", b"one") == "stored"
        assert c.put(b"dup", b"two") == "replaced"  # a put replaces (README, "put replaces")
        assert c.get(b"dup") == b"two"


def test_default_socket_from_env(daemon: RunningDaemon,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_SOCKET", str(daemon.socket_path))
    with Client() as c:
        assert c.health()["status"] == "ok"


def test_dead_daemon_is_a_connection_error(tmp_path) -> None:
    with pytest.raises(DaemonUnavailable, match="is `kvstore serve` running"):
        Client(tmp_path / "nothing.sock")
    assert issubclass(DaemonUnavailable, ConnectionError)


def test_many_requests_in_flight_from_many_threads(daemon: RunningDaemon) -> None:
    errors: list[BaseException] = []
    with daemon.client() as c:
        def worker(t: int) -> None:
            try:
                for i in range(20):
                    value = random_bytes(100 + i, seed=t * 100 + i)
                    c.put(f"thr-{t}-{i}".encode(), value)
                    assert c.get(f"thr-{t}-{i}".encode()) == value
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    assert not errors, errors


def test_async_handles_poll_and_wait(daemon: RunningDaemon) -> None:
    with daemon.client() as c:
        c.put(b"async-key", b"async-value")
        handles = [c.request("get", {"key": b"async-key"}) for _ in range(10)]
        lookups = [c.lookup_async(b"\x00" * 16, [b"\x01" * 16], [b"x"]) for _ in range(5)]
        for h in handles:
            assert h.wait(10)["value"] == b"async-value"
            assert h.poll()
        for h in lookups:
            reply = h.wait(10)
            assert reply == LookupReply(0, [], None)
        bad = c.request("get", {"key": 5})
        with pytest.raises(ClientError) as info:
            bad.wait(10)
        assert info.value.code == "bad_request"


def test_deadline_exceeded_reply(daemon: RunningDaemon) -> None:
    with daemon.client() as c:
        with pytest.raises(ClientError) as info:
            # 48 MiB cannot be copied into the pool in 1 ms; the reply says so, the daemon lives.
            c.call("put", {"key": b"big-slow", "value": bytes(48 << 20)}, timeout_s=0.001)
        assert info.value.code == "deadline_exceeded"
        assert c.health()["status"] == "ok"
        assert c.stats()["daemon"]["errors"].get("deadline_exceeded", 0) >= 1


def test_a_value_a_get_could_not_return_is_refused_at_put(make_daemon) -> None:
    """A raw put of a 256 MiB value with an empty key fitted its frame, but its get's reply (one
    byte of envelope more) did not: stored, and never readable. The largest value a get can
    return is stored and read back; one byte more is refused, and says why."""
    daemon = make_daemon(dram="300MiB")
    sock = raw_connect(daemon.socket_path, timeout_s=60)
    try:
        send_message(sock, {"id": 1, "verb": "put", "args": {
            "key": b"", "value": bytes(proto.MAX_VALUE_BYTES + 1)}})
        reply = recv_message(sock)
        assert not reply["ok"] and reply["error"]["code"] == proto.BAD_REQUEST
        assert "a get's reply must fit one frame" in reply["error"]["message"]
    finally:
        sock.close()
    value = b"\x07" * proto.MAX_VALUE_BYTES
    with daemon.client(timeout_s=60) as c:
        c.put(b"", value)
        assert c.get(b"") == value


def test_value_larger_than_pool_is_an_error(daemon: RunningDaemon) -> None:
    with daemon.client() as c:
        with pytest.raises(ClientError) as info:
            c.put(b"too-big", bytes(65 << 20))  # the shared daemon has 64 MiB of DRAM
        assert info.value.code == "store_error"
        assert c.get(b"too-big") is None


def test_big_request_while_replies_pile_up(make_daemon) -> None:
    # 100 x 1 MiB of replies queue up while one thread writes a 48 MiB request: the client's
    # reader must keep draining them, or both sides would block on full socket buffers.
    running = make_daemon(dram="256MiB", http=False)
    value = random_bytes(1 << 20, seed=99)
    with running.client() as c:
        c.put(b"pile", value)
        handles = [c.request("get", {"key": b"pile"}) for _ in range(100)]
        c.put(b"big", bytes(48 << 20))
        assert all(h.wait(30)["value"] == value for h in handles)
        assert len(c.get(b"big")) == 48 << 20
