"""The key filter's file: what the daemon adds, a view in another mapping reads; a rebuild keeps
every hash still held and those added while it ran, drops the rest, and starts by itself once
the filter has taken as many hashes as it was sized for; a view refuses another daemon's file or
a file that is not a filter; closing removes the file."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
from daemon_helpers import wait_until

from kvstore.key_filter import (
    MAX_BITS,
    MIN_BITS,
    KeyFilter,
    KeyFilterView,
    filter_bits,
    key_filter_path,
)


def _hashes(seed: int, n: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(16) for _ in range(n)]


def _opened(tmp_path: Path, held: list[bytes], num_bits: int = MIN_BITS) -> KeyFilter:
    made = KeyFilter(num_bits)
    made.open(tmp_path / "kvstore.sock.keys", lambda: list(held))
    return made


def test_a_view_reads_what_the_daemon_holds_and_adds(tmp_path: Path) -> None:
    held, later, never = _hashes(1, 50), _hashes(2, 50), _hashes(3, 200)
    keys = _opened(tmp_path, held)
    view = KeyFilterView(keys.path, keys.nonce)
    try:
        assert all(view.may_contain(h) for h in held)  # filled at open
        assert not any(view.may_contain(h) for h in later)
        keys.add(later)
        assert all(view.may_contain(h) for h in later)  # seen at once through the other map
        # 100 keys in 8M bits: a false positive among 200 is below one in 10^12
        assert not any(view.may_contain(h) for h in never)
        assert view.may_contain(b"short")  # not a block hash: never a sure miss
    finally:
        view.close()
        keys.close()
    assert not (tmp_path / "kvstore.sock.keys").exists()


def test_a_rebuild_keeps_what_is_held_and_what_came_meanwhile(tmp_path: Path) -> None:
    held, dropped, meanwhile = _hashes(4, 40), _hashes(5, 40), _hashes(6, 10)
    now_held = held + dropped
    keys = _opened(tmp_path, now_held)

    def enumerate_held() -> list[bytes]:
        keys.add(meanwhile)  # a save while the rebuild reads the tiers
        return list(held)

    keys._live = enumerate_held  # what the tiers hold at the rebuild: ``dropped`` left
    view = KeyFilterView(keys.path, keys.nonce)
    try:
        keys.rebuild()
        assert all(view.may_contain(h) for h in held + meanwhile)
        assert not any(view.may_contain(h) for h in dropped)
        assert keys.stats()["rebuilds"] == 1
    finally:
        view.close()
        keys.close()


def test_a_rebuild_starts_once_the_filter_took_what_it_was_sized_for(tmp_path: Path) -> None:
    held: list[bytes] = []
    keys = KeyFilter(1 << 12)  # sized for 256 hashes
    keys.open(tmp_path / "k.keys", lambda: list(held))
    try:
        held.extend(_hashes(7, keys.rebuild_after - 1))
        keys.add(held)
        assert keys.stats()["rebuilds"] == 0
        keys.add(_hashes(8, 1))
        assert wait_until(lambda: keys.stats()["rebuilds"] == 1, timeout_s=10.0)
        assert keys.stats()["added_since_rebuild"] == 0
    finally:
        keys.close()


def test_adds_racing_a_rebuild_are_never_lost(tmp_path: Path) -> None:
    held = _hashes(9, 500)
    keys = _opened(tmp_path, held)
    added: list[bytes] = []
    stop = threading.Event()

    def saver() -> None:
        seed = 100
        while not stop.is_set():
            batch = _hashes(seed, 8)
            keys.add(batch)
            added.extend(batch)
            seed += 1

    thread = threading.Thread(target=saver)
    thread.start()
    try:
        for _ in range(20):
            keys._live = lambda: list(held) + list(added)  # noqa: B023
            keys.rebuild()
    finally:
        stop.set()
        thread.join()
    view = KeyFilterView(keys.path, keys.nonce)
    try:
        assert all(view.may_contain(h) for h in held + added)
    finally:
        view.close()
        keys.close()


def test_a_view_refuses_another_daemons_file_and_what_is_no_filter(tmp_path: Path) -> None:
    keys = _opened(tmp_path, [])
    try:
        with pytest.raises(ValueError, match="another daemon"):
            KeyFilterView(keys.path, keys.nonce + 1)
        short = tmp_path / "short.keys"
        short.write_bytes(b"\0" * 10)
        with pytest.raises(ValueError, match="too short"):
            KeyFilterView(short, 0)
        wrong = tmp_path / "wrong.keys"
        wrong.write_bytes(b"x" * (64 + MIN_BITS // 8))
        with pytest.raises(ValueError, match="not a key filter"):
            KeyFilterView(wrong, 0)
        with pytest.raises(OSError):
            KeyFilterView(tmp_path / "missing.keys", 0)
    finally:
        keys.close()


def test_the_file_is_private_and_a_stale_one_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "kvstore.sock.keys"
    path.write_bytes(b"left by a daemon that died")
    keys = KeyFilter(MIN_BITS)
    keys.open(path, list)
    try:
        assert path.stat().st_mode & 0o777 == 0o600
        assert path.stat().st_size == 64 + MIN_BITS // 8
        KeyFilterView(path, keys.nonce).close()
    finally:
        keys.close()


def test_with_a_socket_group_the_group_reads_it(tmp_path: Path) -> None:
    keys = KeyFilter(MIN_BITS)
    keys.open(tmp_path / "kvstore.sock.keys", list, group_id=os.getgid())
    try:
        info = keys.path.stat()
        assert info.st_mode & 0o777 == 0o640 and info.st_gid == os.getgid()
    finally:
        keys.close()


def test_sizes() -> None:
    assert filter_bits(0) == MIN_BITS
    assert filter_bits(64 << 30) == 1 << 24  # 1M blocks of 64 KiB, 16 bits each
    assert filter_bits(1 << 50) == MAX_BITS
    assert key_filter_path(Path("/run/kvstore/kvstore.sock")) == \
        Path("/run/kvstore/kvstore.sock.keys")
    with pytest.raises(ValueError, match="power of two"):
        KeyFilter(1000)


def test_a_failed_rebuild_is_counted_and_keeps_every_bit(tmp_path: Path) -> None:
    held = _hashes(12, 100)
    calls = []

    def live() -> list[bytes]:
        calls.append(1)
        if len(calls) > 1:  # the opening fill reads the tiers; the rebuild's read fails
            raise OSError("the SSD index could not be read")
        return list(held)

    keys = KeyFilter(1 << 12)  # sized for 256 hashes
    keys.open(tmp_path / "k.keys", live)
    view = KeyFilterView(keys.path, keys.nonce)
    try:
        later = _hashes(13, keys.rebuild_after)
        keys.add(later)  # starts a rebuild, whose read of the tiers fails
        assert wait_until(lambda: keys.stats()["rebuild_failures"] == 1, timeout_s=10.0)
        assert keys.stats()["rebuilds"] == 0
        assert all(view.may_contain(h) for h in held + later)  # no bit was cleared
        after = _hashes(14, 5)
        keys.add(after)  # adding goes on, and no rebuild is left half begun
        assert all(view.may_contain(h) for h in after)
        assert keys._pending is None
    finally:
        view.close()
        keys.close()


@pytest.mark.parametrize("entry", [
    "not a dict", {"authoritative": True, "nonce": 1},
    {"path": 7, "authoritative": True, "nonce": 1},
    {"path": "/x.keys", "authoritative": "yes", "nonce": 1},
    {"path": "/x.keys", "authoritative": True, "nonce": True},
    {"path": "/x.keys", "authoritative": True, "nonce": 1.5},
])
def test_a_malformed_key_filter_in_the_hello_means_no_filter(entry) -> None:
    from kvstore.wire.handshake import key_filter_info

    assert key_filter_info({"ok": True, "result": {"key_filter": entry}}) is None
    good = {"path": "/x.keys", "authoritative": False, "nonce": 3, "extra": 1}
    assert key_filter_info({"ok": True, "result": {"key_filter": good}}) == {
        "path": "/x.keys", "authoritative": False, "nonce": 3}
    assert key_filter_info({"ok": False, "error": {"code": "x"}}) is None
