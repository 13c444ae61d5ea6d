"""Leases through a real daemon: release, expiry, and a dead client's leases and mappings."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import xxhash
from daemon_helpers import (
    REPO_ROOT,
    RunningDaemon,
    raw_connect,
    recv_message,
    send_message,
    wait_until,
)

from kvstore.keys import Namespace
from kvstore.wire.client import ClientError

pytestmark = pytest.mark.timeout(60)


def _bytes_block(key: bytes, namespace: str = "default") -> tuple[bytes, list[bytes], list[bytes]]:
    """The (namespace digest, hashes, idents) under which `put(key, ...)` stored its block."""
    return Namespace(name=namespace).digest, [xxhash.xxh3_128_digest(key)], [key]


def _leases(daemon: RunningDaemon) -> tuple[int, int]:
    """(the daemon's lease table, the store's own lease count)."""
    with daemon.client() as c:
        stats = c.stats()
    return stats["daemon"]["leases_active"], stats["leases"]


def test_release(daemon: RunningDaemon) -> None:
    with daemon.client() as c:
        c.put(b"lease-release", b"v")
        before = _leases(daemon)
        hit = c.lookup(*_bytes_block(b"lease-release"))
        assert hit.num_hit == 1 and hit.tiers == ["dram"] and hit.lease_id is not None
        assert _leases(daemon) == (before[0] + 1, before[1] + 1)
        assert c.release(hit.lease_id) is True
        assert c.release(hit.lease_id) is False
        assert _leases(daemon) == before


def test_disconnect_releases_leases(daemon: RunningDaemon) -> None:
    with daemon.client() as c:
        c.put(b"lease-disconnect", b"v")
    before = _leases(daemon)
    ns, hashes, idents = _bytes_block(b"lease-disconnect")
    sock = raw_connect(daemon.socket_path)
    for i in range(3):
        send_message(sock, {"id": i, "verb": "lookup",
                            "args": {"namespace": ns, "hashes": hashes, "idents": idents}})
        assert recv_message(sock)["result"]["num_hit"] == 1
    assert _leases(daemon) == (before[0] + 3, before[1] + 3)
    sock.close()
    assert wait_until(lambda: _leases(daemon) == before, timeout_s=5)


def test_disconnect_mid_request_releases_its_lease(daemon: RunningDaemon) -> None:
    with daemon.client() as c:
        c.put(b"lease-mid", b"v")
    before = _leases(daemon)
    ns, hashes, idents = _bytes_block(b"lease-mid")
    for _ in range(20):
        sock = raw_connect(daemon.socket_path)
        send_message(sock, {"id": 1, "verb": "lookup",
                            "args": {"namespace": ns, "hashes": hashes, "idents": idents}})
        sock.close()  # gone before the reply: nobody can ever release that lease
    assert wait_until(lambda: _leases(daemon) == before, timeout_s=5)


def test_crashed_engine_process_leaves_nothing_behind(daemon: RunningDaemon) -> None:
    with daemon.client() as c:
        c.put(b"lease-crash", b"v")
        base = c.stats()["daemon"]
    script = textwrap.dedent(f"""
        import os, sys
        import xxhash
        from kvstore.wire.client import Client
        from kvstore.keys import Namespace
        from kvstore.layout import KVLayout, Region
        from offload.anon_memory import AnonymousMemory
        memory = AnonymousMemory(8 * 4096, "doomed")
        c = Client({str(daemon.socket_path)!r})
        c.register(KVLayout(8, (Region(0, memory.size_bytes, 0, 4096, 4096),),
                            fds=(memory.fd,)), "doomed")
        hit = c.lookup(Namespace(name="default").digest,
                       [xxhash.xxh3_128_digest(b"lease-crash")], [b"lease-crash"])
        assert hit.lease_id is not None
        print("holding", flush=True)
        sys.stdin.readline()
        os._exit(1)  # no close, no unregister, no release: an engine crash
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "holding"
        with daemon.client() as c:
            mid = c.stats()["daemon"]
        assert mid["registrations"] == base["registrations"] + 1
        assert mid["leases_active"] == base["leases_active"] + 1
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(10) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def back_to_base() -> bool:
        with daemon.client() as c:
            now = c.stats()["daemon"]
        return (now["registrations"], now["leases_active"]) == (
            base["registrations"], base["leases_active"])

    assert wait_until(back_to_base, timeout_s=5)
    with daemon.client() as c:
        assert c.get(b"lease-crash") == b"v"  # the crash lost no stored data


def test_lease_expiry(make_daemon) -> None:
    running = make_daemon("--lease-ttl", "0.3", http=False)
    with running.client() as c:
        c.put(b"short-lived", b"v")
        hit = c.lookup(*_bytes_block(b"short-lived"))
        assert hit.lease_id is not None
        assert c.stats()["daemon"]["leases_active"] == 1
        assert wait_until(lambda: c.stats()["daemon"]["leases_active"] == 0, timeout_s=5)
        assert c.stats()["leases"] == 0
        assert c.release(hit.lease_id) is False
        with pytest.raises(ClientError) as info:
            c.load(1, hit.lease_id, [0])
        assert info.value.code == "not_found"
        assert c.stats()["daemon"]["events"]["leases_expired"] >= 1
        # An explicit TTL above the daemon's limit is clamped to it.
        hit = c.lookup(*_bytes_block(b"short-lived"), lease_ttl_s=3600)
        assert wait_until(lambda: c.stats()["daemon"]["leases_active"] == 0, timeout_s=5)
