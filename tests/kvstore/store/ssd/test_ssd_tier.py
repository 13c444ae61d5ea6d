"""The SSD tier on its own and across restarts: IO mode, damage is a miss, the index survives."""

from __future__ import annotations

import errno
import os
import shutil

import lmdb
import pytest
from store_helpers import NS, block_bytes, block_key

from kvstore.store.block_store import Tier
from kvstore.store.ssd.tier import SSDTier
from kvstore.store.store_tier import BlockWrite

BLOCK = 16 * 1024


def _write(tier: SSDTier, indices, size=BLOCK) -> list[bool]:
    items = []
    for i in indices:
        h, ident = block_key(i)
        items.append(BlockWrite(NS + h, ident, memoryview(block_bytes(i, size)), size))
    return tier.write_many(items)


def _read(tier: SSDTier, i: int, size=BLOCK) -> bytes | None:
    h, ident = block_key(i)
    entry = tier.lookup(NS + h)
    if entry is None or entry.ident != ident:
        return None
    buf = bytearray(size + 4096)
    return bytes(buf[:size]) if tier.read_into(entry, memoryview(buf)) else None


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("io_mode", ["auto", "buffered"])
def test_round_trip_and_reported_io_mode(tmp_path, io_mode):
    tier = SSDTier(tmp_path, 64 * BLOCK, io_mode=io_mode)
    try:
        stats = tier.stats()
        if io_mode == "buffered":
            assert stats["io_mode"] == "buffered" and stats["io_mode_reason"] == "requested"
        else:  # O_DIRECT where the filesystem takes it, else a named fallback
            assert stats["io_mode"] in ("direct", "buffered") and stats["io_mode_reason"]
        assert _write(tier, range(10)) == [True] * 10
        assert _write(tier, [3]) == [True]  # already there
        for i in range(10):
            assert _read(tier, i) == block_bytes(i, BLOCK)
        # An unaligned destination goes through a bounce buffer in direct mode.
        h, ident = block_key(4)
        buf = bytearray(BLOCK + 1)
        assert tier.read_into(tier.lookup(NS + h), memoryview(buf)[1:])
        assert bytes(buf[1:]) == block_bytes(4, BLOCK)
        assert tier.stats()["counters"]["writes"] == 10
        tier.check_integrity()
    finally:
        tier.close()


def test_direct_mode_is_refused_loudly_when_required_and_unsupported(tmp_path):
    # "direct" must either really be O_DIRECT or fail at open; never a silent fallback.
    try:
        tier = SSDTier(tmp_path, 8 * BLOCK, io_mode="direct")
    except OSError as exc:
        assert exc.errno in (errno.EINVAL, errno.EOPNOTSUPP)
        return
    try:
        assert tier.stats()["io_mode"] == "direct"
        assert _write(tier, [1]) == [True] and _read(tier, 1) == block_bytes(1, BLOCK)
    finally:
        tier.close()


def test_second_process_on_the_same_dir_is_refused(tmp_path):
    tier = SSDTier(tmp_path, 8 * BLOCK)
    try:
        with pytest.raises(OSError) as info:
            SSDTier(tmp_path, 8 * BLOCK)
        assert info.value.errno == errno.EBUSY
    finally:
        tier.close()


def test_blocks_spread_over_several_files_survive_reopen(tmp_path):
    tier = SSDTier(tmp_path, 32 * BLOCK, max_file_bytes=8 * BLOCK)
    assert tier.stats()["files"] == 4
    assert _write(tier, range(24)) == [True] * 24
    tier.close()
    tier = SSDTier(tmp_path, 32 * BLOCK, max_file_bytes=8 * BLOCK)
    try:
        assert tier.num_blocks == 24
        for i in range(24):
            assert _read(tier, i) == block_bytes(i, BLOCK)
        tier.check_integrity()
    finally:
        tier.close()


def test_restart_keeps_write_order_for_eviction(tmp_path):
    tier = SSDTier(tmp_path, 8 * BLOCK)
    _write(tier, range(8))
    tier.close()
    tier = SSDTier(tmp_path, 8 * BLOCK)
    try:
        _write(tier, [100, 101])
        assert _read(tier, 0) is None and _read(tier, 1) is None  # the oldest went first
        assert all(_read(tier, i) == block_bytes(i, BLOCK) for i in range(2, 8))
        tier.check_integrity()
    finally:
        tier.close()


def test_flipped_byte_while_running_is_a_dropped_miss(tmp_path):
    tier = SSDTier(tmp_path, 16 * BLOCK)
    try:
        _write(tier, range(3))
        h, _ = block_key(1)
        path, offset, _ = tier.locate(NS + h)
        _flip(path, offset + BLOCK - 1)
        assert _read(tier, 1) is None
        assert _read(tier, 0) == block_bytes(0, BLOCK) and _read(tier, 2) == block_bytes(2, BLOCK)
        stats = tier.stats()
        assert stats["counters"]["corrupt"] == 1 and stats["blocks"] == 2
        assert tier.lookup(NS + h) is None
        tier.check_integrity()
    finally:
        tier.close()


def test_truncated_file_while_running_is_a_dropped_miss(tmp_path):
    tier = SSDTier(tmp_path, 16 * BLOCK)
    try:
        _write(tier, range(3))
        h, _ = block_key(2)
        path, offset, _ = tier.locate(NS + h)
        with open(path, "r+b") as f:
            f.truncate(offset + 100)
        assert _read(tier, 2) is None
        assert tier.stats()["counters"]["corrupt"] == 1
        tier.check_integrity()
    finally:
        tier.close()


def _store_with_blocks(make_store, ssd_dir, indices):
    store = make_store(dram_bytes=256 * BLOCK, ssd_dir=ssd_dir, ssd_bytes=256 * BLOCK)
    for i in indices:
        h, ident = block_key(i)
        store.put(NS, h, ident, block_bytes(i, BLOCK))
    assert store.flush_to_ssd() == len(indices)
    locations = {i: store.ssd_tier.locate(NS + block_key(i)[0]) for i in indices}
    store.close()
    return locations


def _reopen(make_store, ssd_dir):
    return make_store(dram_bytes=256 * BLOCK, ssd_dir=ssd_dir, ssd_bytes=256 * BLOCK)


def _get(store, i):
    h, ident = block_key(i)
    return store.get(NS, h, ident)


def test_store_restart_serves_from_ssd(make_store, tmp_path):
    _store_with_blocks(make_store, tmp_path / "ssd", range(10))
    store = _reopen(make_store, tmp_path / "ssd")
    assert store.stats()["tiers"]["ssd"]["blocks"] == 10
    h, ident = block_key(3)
    assert store.lookup(NS, [h], [ident], lease_ttl_s=None).tiers == [Tier.SSD]
    for i in range(10):
        assert _get(store, i) == block_bytes(i, BLOCK)
    store.check_integrity()


def test_flipped_bytes_found_after_restart_are_misses(make_store, tmp_path):
    where = _store_with_blocks(make_store, tmp_path / "ssd", range(6))
    path, offset, _ = where[2]
    _flip(path, offset)
    store = _reopen(make_store, tmp_path / "ssd")
    assert _get(store, 2) is None
    assert _get(store, 2) is None  # dropped: the second miss does no IO
    assert all(_get(store, i) == block_bytes(i, BLOCK) for i in (0, 1, 3, 4, 5))
    ssd = store.stats()["tiers"]["ssd"]
    assert ssd["counters"]["corrupt"] == 1 and ssd["blocks"] == 5
    store.check_integrity()


def test_truncated_file_found_at_restart_drops_what_it_cut(make_store, tmp_path):
    where = _store_with_blocks(make_store, tmp_path / "ssd", range(6))
    cut_at = sorted(offset for _, offset, _ in where.values())[3]  # keep three blocks whole
    path = where[0][0]
    with open(path, "r+b") as f:
        f.truncate(cut_at + 10)
    store = _reopen(make_store, tmp_path / "ssd")
    ssd = store.stats()["tiers"]["ssd"]
    assert ssd["counters"]["lost_at_start"] == 3 and ssd["blocks"] == 3
    served = [i for i in range(6) if _get(store, i) is not None]
    assert served == sorted(i for i, (_, off, _) in where.items() if off < cut_at)
    assert all(_get(store, i) == block_bytes(i, BLOCK) for i in served)
    store.check_integrity()


def test_deleted_data_file_is_misses_and_the_tier_keeps_working(make_store, tmp_path):
    where = _store_with_blocks(make_store, tmp_path / "ssd", range(4))
    where[0][0].unlink()
    store = _reopen(make_store, tmp_path / "ssd")
    assert all(_get(store, i) is None for i in range(4))
    assert store.stats()["tiers"]["ssd"]["counters"]["lost_at_start"] == 4
    h, ident = block_key(50)
    store.put(NS, h, ident, block_bytes(50, BLOCK))
    assert store.flush_to_ssd() == 1
    store.check_integrity()


@pytest.mark.parametrize("damage", ["delete", "garbage", "truncate", "zero-pages"])
def test_lost_or_corrupt_lmdb_starts_empty(make_store, tmp_path, damage):
    _store_with_blocks(make_store, tmp_path / "ssd", range(200))
    index = tmp_path / "ssd" / "index.lmdb"
    data = index / "data.mdb"
    env = lmdb.open(str(index), readonly=True, lock=False)
    size = (env.info()["last_pgno"] + 1) * 4096  # the pages in use (the file is preallocated)
    env.close()
    if damage == "delete":
        shutil.rmtree(index)
    elif damage == "garbage":
        data.write_bytes(b"\x17not an lmdb file" * 1000)
    elif damage == "truncate":  # walking it in-process would SIGBUS
        os.truncate(data, size // 2)
    else:  # every page after the two meta pages: in-process this can abort() inside LMDB
        with open(data, "r+b") as f:
            f.seek(2 * 4096)
            f.write(bytes(size - 2 * 4096))
    store = _reopen(make_store, tmp_path / "ssd")
    ssd = store.stats()["tiers"]["ssd"]
    assert ssd["blocks"] == 0 and ssd["counters"]["index_resets"] == 1
    assert all(_get(store, i) is None for i in range(200))
    h, ident = block_key(700)  # and it keeps working
    store.put(NS, h, ident, block_bytes(700, BLOCK))
    assert store.flush_to_ssd() == 1
    store.check_integrity()


def test_changed_size_resets_the_layout(make_store, tmp_path):
    _store_with_blocks(make_store, tmp_path / "ssd", range(4))
    store = make_store(dram_bytes=64 * BLOCK, ssd_dir=tmp_path / "ssd", ssd_bytes=128 * BLOCK)
    ssd = store.stats()["tiers"]["ssd"]
    assert ssd["blocks"] == 0 and ssd["counters"]["layout_resets"] == 1
    assert ssd["capacity_bytes"] == 128 * BLOCK
    store.check_integrity()


def test_padding_of_a_reused_dram_slot_reaches_the_disk_as_zeros(make_store, tmp_path):
    store = make_store(dram_bytes=64 * BLOCK, ssd_dir=tmp_path / "ssd", ssd_bytes=64 * BLOCK)
    if store.stats()["tiers"]["ssd"]["io_mode"] != "direct":
        pytest.skip("only O_DIRECT writes the padding of a block")
    h, ident = block_key(1)
    store.put(NS, h, ident, b"\xee" * 8192)
    assert store.remove(NS, h)
    h, ident = block_key(2)
    store.put(NS, h, ident, block_bytes(2, 4097))  # lands in the freed slot, 4095 B of padding
    assert store.flush_to_ssd() == 1
    path, offset, num_bytes = store.ssd_tier.locate(NS + h)
    with open(path, "rb") as f:
        f.seek(offset)
        raw = f.read(8192)
    assert raw[:num_bytes] == block_bytes(2, 4097)
    assert raw[num_bytes:] == bytes(8192 - num_bytes)
