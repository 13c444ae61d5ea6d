"""Issue 21 item 8: a bytes-API ``put`` of an existing key used to keep the old value silently
(reply ``stored: False``, ``Client.put`` returned None). A put now replaces the value in every
tier of the daemon and says so; a reader sees the old value or the new one, never a mix; a value
replaced once never comes back (after a demotion to SSD, a clean restart or a kill -9)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from daemon_helpers import RunningDaemon

VALUE_BYTES = 256 * 1024


def _value(tag: int) -> bytes:
    return bytes([tag]) * VALUE_BYTES


def _push_to_ssd(c, key: bytes, num_fillers: int = 24) -> None:
    """Fill the 4 MiB DRAM pool until ``key``'s block was demoted; assert it sits on SSD."""
    for i in range(num_fillers):
        c.put(b"filler-%d-%d" % (i, time.monotonic_ns()), _value(200 + i % 50))
    stats = c.stats()
    assert stats["tiers"]["ssd"]["blocks"] > 0, stats["tiers"]


def test_put_replaces_and_says_so(make_daemon) -> None:
    daemon: RunningDaemon = make_daemon(dram="8MiB")
    with daemon.client() as c:
        assert c.put(b"k", _value(1)) == "stored"
        assert c.put(b"k", _value(2)) == "replaced"
        assert c.get(b"k") == _value(2)
        assert c.put(b"other", _value(3), namespace="b") == "stored"  # namespaces stay apart
        assert c.get(b"k") == _value(2) and c.get(b"other", namespace="b") == _value(3)
        assert c.stats()["counters"]["puts_replaced"] == 1


def test_put_replaces_a_value_demoted_to_ssd_also_after_restarts(make_daemon,
                                                                   tmp_path: Path) -> None:
    ssd_dir = tmp_path / "ssd"
    daemon: RunningDaemon = make_daemon(dram="4MiB", ssd_dir=ssd_dir, ssd_size="32MiB")
    with daemon.client() as c:
        c.put(b"k", _value(1))
        _push_to_ssd(c, b"k")
        assert c.call("get", {"namespace": "default", "key": b"k"})["tier"] == "ssd"
        assert c.put(b"k", _value(2)) == "replaced"
        assert c.get(b"k") == _value(2)
        _push_to_ssd(c, b"k")  # v2 goes down too: the SSD holds v2, not v1
        assert c.get(b"k") == _value(2)
        assert c.put(b"k", _value(3)) == "replaced"  # v3 in DRAM only, v2 removed from SSD
    assert daemon.stop() == 0  # a clean stop flushes DRAM to SSD

    daemon = make_daemon(dram="4MiB", ssd_dir=ssd_dir, ssd_size="32MiB")
    with daemon.client() as c:
        assert c.get(b"k") == _value(3)
        assert c.put(b"k", _value(4)) == "replaced"  # replaces v3 on SSD, v4 in DRAM only
    daemon.kill9()  # v4 may be lost, but v3 must never come back

    daemon = make_daemon(dram="4MiB", ssd_dir=ssd_dir, ssd_size="32MiB")
    with daemon.client() as c:
        assert c.get(b"k") in (None, _value(4))


def test_readers_see_old_or_new_never_a_mix(make_daemon) -> None:
    daemon: RunningDaemon = make_daemon(dram="16MiB")
    stop = threading.Event()
    seen: list[bytes | None] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            with daemon.client() as c:
                while not stop.is_set():
                    seen.append(c.get(b"hot"))
        except BaseException as exc:  # reported below
            errors.append(exc)

    with daemon.client() as c:
        c.put(b"hot", _value(0))
        readers = [threading.Thread(target=read) for _ in range(3)]
        for t in readers:
            t.start()
        for i in range(60):
            assert c.put(b"hot", _value(1 + i % 2)) == "replaced"
        stop.set()
        for t in readers:
            t.join(10)
    assert not errors, errors
    assert seen and all(v in (_value(0), _value(1), _value(2)) for v in seen), \
        "a reader saw a missing or mixed value"
