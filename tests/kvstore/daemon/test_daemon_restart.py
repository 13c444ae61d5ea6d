"""SSD persistence through the daemon: kill -9 or SIGTERM, restart on the same --ssd-dir."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xxhash
from daemon_helpers import random_bytes, wait_until

from kvstore.keys import Namespace
from kvstore.wire.client import Client

pytestmark = pytest.mark.timeout(90)

NUM_VALUES = 40
VALUE_BYTES = 200 * 1024  # 8 MiB in all, through a 4 MiB DRAM pool


def _values() -> dict[bytes, bytes]:
    return {f"persist-{i}".encode(): random_bytes(VALUE_BYTES, seed=1000 + i)
            for i in range(NUM_VALUES)}


def _tier_of(c: Client, key: bytes) -> str | None:
    return c.call("get", {"key": key})["tier"]


def _block(key: bytes) -> tuple[bytes, list[bytes], list[bytes]]:
    """Where `put(key)` stored its block: (namespace digest, [hash], [ident])."""
    return Namespace(name="default").digest, [xxhash.xxh3_128_digest(key)], [key]


def _put_all(c: Client, values: dict[bytes, bytes]) -> None:
    for key, value in values.items():
        c.put(key, value)


def test_kill9_restart_serves_identical_bytes(make_daemon, tmp_path: Path) -> None:
    ssd_dir = tmp_path / "ssd"
    values = _values()
    first = make_daemon(dram="4MiB", ssd_dir=ssd_dir, ssd_size="64MiB", http=False)
    with first.client() as c:
        _put_all(c, values)
        assert wait_until(lambda: c.stats()["tiers"]["ssd"]["blocks"] >= NUM_VALUES // 2)
        # Ask with lease_ttl 0 (no promotion): blocks reported "ssd" have reached the disk.
        on_ssd = [k for k in values if c.lookup(*_block(k), lease_ttl_s=0).tiers == ["ssd"]]
    assert len(on_ssd) >= NUM_VALUES // 2
    first.kill9()  # no flush, no clean close: only what reached the SSD may survive

    second = make_daemon(dram="4MiB", ssd_dir=ssd_dir, ssd_size="64MiB", http=False)
    assert any("blocks recovered" in line and not line.endswith(" 0 blocks recovered")
               for line in second.lines), second.lines
    with second.client() as c:
        for key in on_ssd:
            assert c.get(key) == values[key], f"{key!r} lost or changed across kill -9"
        for key, value in values.items():
            got = c.get(key)
            assert got is None or got == value, f"{key!r} came back with other bytes"


def test_sigterm_flushes_everything(make_daemon, tmp_path: Path) -> None:
    ssd_dir = tmp_path / "ssd"
    values = dict(list(_values().items())[:10])
    first = make_daemon(dram="8MiB", ssd_dir=ssd_dir, ssd_size="64MiB", http=False)
    with first.client() as c:
        _put_all(c, values)
    assert first.stop() == 0  # graceful: DRAM-only blocks are written to SSD first
    second = make_daemon(dram="8MiB", ssd_dir=ssd_dir, ssd_size="64MiB", http=False)
    with second.client() as c:
        for key, value in values.items():
            assert c.get(key) == value


def test_damaged_ssd_files_give_misses_never_other_bytes(make_daemon, tmp_path: Path) -> None:
    ssd_dir = tmp_path / "ssd"
    values = _values()
    first = make_daemon(dram="4MiB", ssd_dir=ssd_dir, ssd_size="64MiB", http=False)
    with first.client() as c:
        _put_all(c, values)
    assert first.stop() == 0
    for data_file in ssd_dir.glob("data-*.bin"):
        with open(data_file, "r+b") as f:  # flip one byte in every 4 KiB
            size = data_file.stat().st_size
            for offset in range(123, size, 4096):
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0xFF]))
    second = make_daemon(dram="4MiB", ssd_dir=ssd_dir, ssd_size="64MiB", http=False)
    with second.client() as c:
        for key in values:
            assert c.get(key) is None, f"{key!r} served from a damaged file"
        assert c.stats()["tiers"]["ssd"]["counters"]["corrupt"] >= 1


def test_values_are_numpy_exact_after_restart(make_daemon, tmp_path: Path) -> None:
    ssd_dir = tmp_path / "ssd"
    arr = np.random.default_rng(5).standard_normal((256, 128)).astype(np.float16)
    first = make_daemon(dram="4MiB", ssd_dir=ssd_dir, ssd_size="32MiB", http=False)
    with first.client() as c:
        c.put(b"fp16", arr)
    first.stop()
    second = make_daemon(dram="4MiB", ssd_dir=ssd_dir, ssd_size="32MiB", http=False)
    with second.client() as c:
        back = np.frombuffer(c.get(b"fp16"), dtype=np.float16).reshape(arr.shape)
        np.testing.assert_array_equal(back, arr)
        assert _tier_of(c, b"fp16") in ("dram", "ssd")
