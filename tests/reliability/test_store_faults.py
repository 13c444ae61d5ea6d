"""SSD faults injected under a real TieredStore: EIO, a full disk, damaged data and index.

A fault-injecting file layer (``FaultyDisk``, passed as the SSD tier's file calls) makes reads,
writes and fdatasync fail the way a broken or full disk does; damage is done to the real files.
Whatever happens: a put never fails for it, a get is the exact bytes or a miss, the miss is
counted, the size cap holds and ``check_integrity()`` passes.
"""

from __future__ import annotations

import os
import random
import shutil
import time

import lmdb
import pytest
from reliability_helpers import (
    NS,
    FaultyDisk,
    assert_exact_or_missing,
    assert_within_cap,
    block_bytes,
    block_key,
    get_block,
    put_blocks,
)

from kvstore.store.block_store import BlockUnavailable, Tier

pytestmark = pytest.mark.timeout(60)

BLOCK = 16 * 1024


def _ssd(store) -> dict:
    return store.stats()["tiers"]["ssd"]


def _settled(store, timeout_s: float = 10.0) -> dict:
    """The store's stats once the demotion thread's batch in flight (if any) has ended: its
    slots are placed before the write and freed after a failed one."""
    deadline = time.monotonic() + timeout_s
    stats = store.stats()
    while stats["tiers"]["dram"]["demoting_blocks"] and time.monotonic() < deadline:
        time.sleep(0.01)
        stats = store.stats()
    assert not stats["tiers"]["dram"]["demoting_blocks"], "demotion did not settle"
    return stats


def _open(make_store, ssd_dir, disk=None, blocks=256, **kwargs):
    kwargs.setdefault("dram_bytes", blocks * BLOCK)
    if disk is not None:
        kwargs["file_ops"] = disk
    return make_store(ssd_dir=ssd_dir, ssd_bytes=blocks * BLOCK, **kwargs)


def _durable(make_store, ssd_dir, indices, size=BLOCK, **kwargs) -> dict:
    """Write blocks through a store, flush them to SSD, close it; returns their locations."""
    store = _open(make_store, ssd_dir, **kwargs)
    put_blocks(store, indices, size)
    assert store.flush_to_ssd() == len(indices)
    where = {i: store.ssd_tier.locate(NS + block_key(i)[0]) for i in indices}
    store.close()
    return where


def test_eio_on_read_is_a_counted_miss_and_quarantined(make_store, tmp_path):
    where = _durable(make_store, tmp_path / "ssd", range(8))
    disk = FaultyDisk()
    store = _open(make_store, tmp_path / "ssd", disk)
    path, offset, _ = where[3]
    disk.eio_reads.add((path.name, offset))
    assert get_block(store, 3) is None
    num_reads = disk.calls["preadv"]
    assert get_block(store, 3) is None  # quarantined: the second ask does no IO
    assert disk.calls["preadv"] == num_reads and disk.faults["eio_read"] == 1
    counters = _ssd(store)["counters"]
    assert (counters["read_errors"], counters["corrupt"]) == (1, 0)
    assert _ssd(store)["blocks"] == 7
    assert store.stats()["counters"]["promotion_failures"] == 1
    assert assert_exact_or_missing(store, [i for i in range(8) if i != 3], BLOCK) == 7
    store.check_integrity()
    store.close()
    # The quarantine is durable (the entry left LMDB), and the tier keeps working.
    store = _open(make_store, tmp_path / "ssd")
    assert _ssd(store)["blocks"] == 7 and get_block(store, 3) is None
    put_blocks(store, [3], BLOCK)
    assert store.flush_to_ssd() == 1
    store.close()
    store = _open(make_store, tmp_path / "ssd")
    assert assert_exact_or_missing(store, range(8), BLOCK) == 8
    store.check_integrity()


def test_eio_in_the_middle_of_a_lease_shortens_the_hit(make_store, tmp_path):
    where = _durable(make_store, tmp_path / "ssd", range(6))
    disk = FaultyDisk()
    store = _open(make_store, tmp_path / "ssd", disk)
    path, offset, _ = where[2]
    disk.eio_reads.add((path.name, offset))
    hashes, idents = zip(*(block_key(i) for i in range(6)))
    result = store.lookup(NS, list(hashes), list(idents), lease_ttl_s=30.0)
    assert result.num_hit == 6 and result.tiers == [Tier.SSD] * 6
    with result.lease as lease:
        for i in range(2):
            assert bytes(store.read(lease, i)) == block_bytes(i, BLOCK)
            store.done(lease, i)
        with pytest.raises(BlockUnavailable):
            store.read(lease, 2)
    stats = store.stats()
    assert stats["leases"] == 0 and stats["tiers"]["dram"]["pinned_blocks"] == 0
    assert stats["tiers"]["ssd"]["pinned_blocks"] == 0
    assert store.lookup(NS, list(hashes), list(idents), lease_ttl_s=None).num_hit == 2
    store.check_integrity()


def test_eio_on_every_write_evicts_instead_of_failing_puts(make_store, tmp_path):
    disk = FaultyDisk()
    disk.eio_writes = True
    store = _open(make_store, tmp_path / "ssd", disk, blocks=64, dram_bytes=8 * BLOCK)
    put_blocks(store, range(40), BLOCK)  # 5x DRAM: every demotion fails, no put does
    assert disk.faults["eio_write"] > 0
    ssd = _settled(store)["tiers"]["ssd"]
    assert ssd["blocks"] == 0 and ssd["used_bytes"] == 0  # no slot leaked by a failed write
    assert ssd["counters"]["write_errors"] > 0
    counters = store.stats()["counters"]
    assert counters["demotion_failures"] > 0 and counters["puts"] == 40
    assert assert_exact_or_missing(store, range(40), BLOCK) <= 8
    store.check_integrity()
    disk.eio_writes = False  # the disk is back: demotion resumes
    put_blocks(store, range(40, 80), BLOCK)
    assert assert_exact_or_missing(store, range(40, 80), BLOCK) == 40
    assert _settled(store)["tiers"]["ssd"]["blocks"] >= 32
    assert_within_cap(store)
    store.check_integrity()


def test_eio_on_fdatasync_never_makes_a_block_visible(make_store, tmp_path):
    disk = FaultyDisk()
    disk.eio_sync = True
    store = _open(make_store, tmp_path / "ssd", disk, blocks=64)
    put_blocks(store, range(10), BLOCK)
    assert store.flush_to_ssd() == 0
    ssd = _ssd(store)
    assert disk.faults["eio_sync"] >= 1
    assert ssd["blocks"] == 0 and ssd["used_bytes"] == 0
    assert ssd["counters"]["write_errors"] == 10
    assert assert_exact_or_missing(store, range(10), BLOCK) == 10  # DRAM kept its copies
    store.check_integrity()
    store.close()
    store = _open(make_store, tmp_path / "ssd", blocks=64)  # nothing unsynced was indexed
    assert _ssd(store)["blocks"] == 0
    assert assert_exact_or_missing(store, range(10), BLOCK) == 0
    store.check_integrity()


def test_full_disk_keeps_serving_what_fits_within_the_cap(make_store, tmp_path):
    # 40 blocks and two pages of room under a 256-block SSD tier: preallocation fails (sparse
    # files), then writes run short and into ENOSPC; older slots are reused.
    disk = FaultyDisk(free_bytes=40 * BLOCK + 2 * 4096)
    store = _open(make_store, tmp_path / "ssd", disk, dram_bytes=8 * BLOCK)
    for start in range(0, 100, 10):
        put_blocks(store, range(start, start + 10), BLOCK)
        store.flush_to_ssd()
    ssd = _ssd(store)
    assert ssd["counters"]["sparse_files"] == 1
    assert ssd["counters"]["enospc"] > 0 and disk.faults["short_write"] >= 1
    assert 10 < ssd["blocks"] <= 40  # it keeps serving what fits, never more than the disk
    assert assert_exact_or_missing(store, range(100), BLOCK) > 10
    assert store.stats()["counters"]["puts"] == 100
    assert_within_cap(store)
    store.check_integrity()
    store.close()
    store = _open(make_store, tmp_path / "ssd", FaultyDisk(free_bytes=0), dram_bytes=8 * BLOCK)
    assert assert_exact_or_missing(store, range(100), BLOCK) > 10
    assert _ssd(store)["counters"]["corrupt"] == 0
    store.check_integrity()


def _index_env(ssd_dir):
    env = lmdb.open(str(ssd_dir / "index.lmdb"), max_dbs=2, subdir=True)
    return env, env.open_db(b"blocks", create=False)


def test_one_corrupt_index_value_drops_only_that_block(make_store, tmp_path):
    _durable(make_store, tmp_path / "ssd", range(8))
    env, db = _index_env(tmp_path / "ssd")
    key = NS + block_key(5)[0]
    with env.begin(write=True, db=db) as txn:
        value = bytearray(txn.get(key))
        value[10] ^= 0x01  # inside the offset field: it would point elsewhere
        txn.put(key, bytes(value))
    env.close()
    store = _open(make_store, tmp_path / "ssd")
    ssd = _ssd(store)
    assert ssd["counters"]["lost_at_start"] == 1 and ssd["blocks"] == 7
    assert get_block(store, 5) is None
    assert assert_exact_or_missing(store, range(8), BLOCK) == 7
    store.check_integrity()


def test_swapped_index_values_are_misses_never_the_other_block(make_store, tmp_path):
    _durable(make_store, tmp_path / "ssd", range(6))
    env, db = _index_env(tmp_path / "ssd")
    key_a, key_b = NS + block_key(1)[0], NS + block_key(4)[0]
    with env.begin(write=True, db=db) as txn:  # each entry is well-formed, under the wrong key
        value_a, value_b = txn.get(key_a), txn.get(key_b)
        txn.put(key_a, value_b)
        txn.put(key_b, value_a)
    env.close()
    store = _open(make_store, tmp_path / "ssd")
    assert _ssd(store)["blocks"] == 6  # nothing looks wrong until it is read
    assert get_block(store, 1) is None and get_block(store, 4) is None  # idents differ
    assert store.stats()["counters"]["collisions"] == 2
    # Even asked with the ident the moved entry carries, the checksum binds bytes to their key.
    hash_a, _ = block_key(1)
    _, ident_b = block_key(4)
    assert store.get(NS, hash_a, ident_b) is None
    assert _ssd(store)["counters"]["corrupt"] == 1
    assert assert_exact_or_missing(store, [0, 2, 3, 5], BLOCK) == 4
    store.check_integrity()


@pytest.mark.parametrize("deleted", ["index", "data"])
def test_files_deleted_while_running_are_misses_after_restart(make_store, tmp_path, deleted):
    ssd_dir = tmp_path / "ssd"
    store = _open(make_store, ssd_dir, blocks=64)
    put_blocks(store, range(8), BLOCK)
    assert store.flush_to_ssd() == 8
    if deleted == "index":
        shutil.rmtree(ssd_dir / "index.lmdb")
    else:
        for path in ssd_dir.glob("data-*.bin"):
            path.unlink()
    # The open descriptors keep the tier working until the restart.
    put_blocks(store, range(8, 12), BLOCK)
    assert store.flush_to_ssd() == 4
    assert assert_exact_or_missing(store, range(12), BLOCK) == 12
    store.check_integrity()
    store.close()
    store = _open(make_store, ssd_dir, blocks=64)
    counters = _ssd(store)["counters"]
    if deleted == "index":
        assert counters["index_resets"] == 1
    else:
        assert counters["lost_at_start"] == 12
    assert _ssd(store)["blocks"] == 0
    assert assert_exact_or_missing(store, range(12), BLOCK) == 0
    put_blocks(store, [12], BLOCK)  # and it starts over
    assert store.flush_to_ssd() == 1
    assert get_block(store, 12) == block_bytes(12, BLOCK)
    store.check_integrity()


def _size(i: int) -> int:
    return 4096 * (1 + i % 5) - 123 * (i % 3)  # 3.8 to 20 KiB: slots of several sizes


def _damage(kinds: list[str], rng: random.Random, ssd_dir, where: dict) -> list[str]:
    """Damage the SSD dir in each way of ``kinds``, at random places; returns what was done."""
    files = sorted(ssd_dir.glob("data-*.bin"))
    used = max(offset + n for _, offset, n in where.values())
    done = []
    for kind in kinds:
        path = rng.choice([f for f in files if f.exists()])
        if kind == "flip":
            with open(path, "r+b") as f:
                for offset in rng.sample(range(min(used, path.stat().st_size)), 20):
                    f.seek(offset)
                    byte = f.read(1)
                    f.seek(offset)
                    f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
        elif kind == "zero-page":
            with open(path, "r+b") as f:
                f.seek(4096 * rng.randrange(max(1, min(used, path.stat().st_size) // 4096)))
                f.write(bytes(4096))
        elif kind == "truncate":
            os.truncate(path, rng.randrange(path.stat().st_size))
        elif kind == "delete":
            path.unlink()
        else:
            env, db = _index_env(ssd_dir)
            with env.begin(write=True, db=db) as txn:
                keys = [bytes(k) for k, _ in txn.cursor()]
                for key in rng.sample(keys, 3):
                    value = bytearray(txn.get(key))
                    value[rng.randrange(len(value))] ^= 0xFF
                    txn.put(key, bytes(value))
            env.close()
        done.append(f"{kind} {path.name}")
    return done


@pytest.mark.parametrize(("seed", "kinds"), [
    (0, ["flip", "zero-page"]),
    (1, ["truncate", "index-value"]),
    (2, ["delete", "flip"]),
    (3, ["flip", "truncate", "index-value", "zero-page"]),
])
def test_random_damage_then_restart_is_exact_bytes_or_a_miss(make_store, tmp_path, seed, kinds):
    ssd_dir = tmp_path / "ssd"
    num_blocks = 48
    store = _open(make_store, ssd_dir, blocks=96, ssd_max_file_bytes=32 * BLOCK)
    for i in range(num_blocks):
        h, ident = block_key(i)
        store.put(NS, h, ident, block_bytes(i, _size(i)))
    assert store.flush_to_ssd() == num_blocks
    where = {i: store.ssd_tier.locate(NS + block_key(i)[0]) for i in range(num_blocks)}
    store.close()
    done = _damage(kinds, random.Random(seed), ssd_dir, where)

    def check(store) -> int:
        served = 0
        for i in range(num_blocks):
            got = get_block(store, i)
            assert got is None or got == block_bytes(i, _size(i)), f"{done}: block {i}"
            served += got is not None
        assert_within_cap(store)
        store.check_integrity()
        return served

    store = _open(make_store, ssd_dir, blocks=96, ssd_max_file_bytes=32 * BLOCK)
    served = check(store)
    ssd = _ssd(store)
    # Every block is accounted for: served, or counted as lost at start or corrupt on read.
    lost = ssd["counters"]["lost_at_start"] + ssd["counters"]["corrupt"]
    assert lost > 0 and served + lost == num_blocks, (done, served, ssd["counters"])
    for i in range(num_blocks, num_blocks + 20):  # the damaged tier keeps taking blocks
        h, ident = block_key(i)
        store.put(NS, h, ident, block_bytes(i, _size(i)))
    store.flush_to_ssd()
    store.close()
    store = _open(make_store, ssd_dir, blocks=96, ssd_max_file_bytes=32 * BLOCK)
    assert check(store) == served  # what survived the damage survives a restart
    for i in range(num_blocks, num_blocks + 20):
        h, ident = block_key(i)
        assert store.get(NS, h, ident) == block_bytes(i, _size(i)), (done, i)
