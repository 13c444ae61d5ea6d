"""Isolation through the daemon: namespaces per model identity, dtype, layout, tenant and LoRA
never share a block, the same namespace always does, and a forced hash collision is a miss on
every tier (DRAM and SSD), never another block's bytes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import xxhash
from daemon_helpers import random_bytes
from reliability_helpers import InProcessDaemon

from kvstore.keys import ModelIdentity, Namespace, block_hashes, block_ident, truncate_hash
from kvstore.store.tiered import StoreConfig

pytestmark = pytest.mark.timeout(120)

MODEL = ModelIdentity("Qwen3ForCausalLM", num_layers=36, num_kv_heads=8, head_dim=128,
                      kv_dtype="bfloat16", block_size=16, weights_id="sha256:base")
TOKENS = np.random.default_rng(1).integers(0, 50_000, 6 * 16)
NUM_BLOCKS, BLOCK_BYTES = 6, 16 * 1024

# One change at a time: every field that makes KV bytes differ must make the namespace differ.
VARIANTS = {
    "architecture": Namespace(model=dataclasses.replace(MODEL, architecture="LlamaForCausalLM")),
    "num_layers": Namespace(model=dataclasses.replace(MODEL, num_layers=28)),
    "num_kv_heads": Namespace(model=dataclasses.replace(MODEL, num_kv_heads=4)),
    "head_dim": Namespace(model=dataclasses.replace(MODEL, head_dim=64)),
    "dtype float16": Namespace(model=dataclasses.replace(MODEL, kv_dtype="float16")),
    "dtype float32": Namespace(model=dataclasses.replace(MODEL, kv_dtype="float32")),
    "dtype fp8": Namespace(model=dataclasses.replace(MODEL, kv_dtype="float8_e4m3fn")),
    "block_size": Namespace(model=dataclasses.replace(MODEL, block_size=32)),
    "layout version": Namespace(model=dataclasses.replace(MODEL, kv_layout_version=2)),
    "weights": Namespace(model=dataclasses.replace(MODEL, weights_id="sha256:finetuned")),
    "tenant": Namespace(model=MODEL, tenant_salt="tenant-b"),
    "lora": Namespace(model=MODEL, lora_id="adapter-1"),
    "hash scheme": Namespace(model=MODEL, hash_scheme_version=2),
    "no model": Namespace(),
}
BASE = Namespace(model=MODEL, tenant_salt="tenant-a")


def _chain(namespace: Namespace, block_size: int = 16) -> tuple[bytes, list[bytes], list[bytes]]:
    digest = namespace.digest
    hashes = block_hashes(digest, TOKENS, block_size)
    parents = [digest, *hashes[:-1]]
    idents = [block_ident(parents[i], TOKENS[i * block_size:(i + 1) * block_size])
              for i in range(len(hashes))]
    return digest, hashes, idents


def test_every_identity_field_and_tenant_separates_namespaces() -> None:
    digests = {name: ns.digest for name, ns in VARIANTS.items()} | {"base": BASE.digest}
    assert len(set(digests.values())) == len(digests)
    # The same identity built again (as another engine would) is the same namespace.
    again = Namespace(model=ModelIdentity(**dataclasses.asdict(MODEL)), tenant_salt="tenant-a")
    assert again.digest == BASE.digest and _chain(again) == _chain(BASE)


def test_blocks_of_one_namespace_never_serve_another() -> None:
    daemon = InProcessDaemon(StoreConfig(dram_bytes=8 << 20))
    try:
        with daemon.client() as c:
            digest, hashes, idents = _chain(BASE)
            for i, (h, ident) in enumerate(zip(hashes, idents)):  # same tokens, same bytes
                daemon.store.put(digest, h, ident, random_bytes(BLOCK_BYTES, seed=i))
            assert c.lookup(digest, hashes, idents, lease_ttl_s=0).num_hit == NUM_BLOCKS
            for name, ns in VARIANTS.items():
                block_size = ns.model.block_size if ns.model is not None else 16
                other, other_hashes, other_idents = _chain(ns, block_size)
                assert c.lookup(other, other_hashes, other_idents, lease_ttl_s=0).num_hit == 0, \
                    name
                # A client that sends the other namespace with this chain's hashes and idents
                # reaches nothing either: the namespace is part of every key.
                assert c.lookup(other, hashes, idents, lease_ttl_s=0).num_hit == 0, name
            # Paired: the same namespace, computed anew, shares every block, byte-exact.
            again = Namespace(model=dataclasses.replace(MODEL), tenant_salt="tenant-a")
            digest2, hashes2, idents2 = _chain(again)
            assert c.lookup(digest2, hashes2, idents2, lease_ttl_s=0).num_hit == NUM_BLOCKS
        for i, (h, ident) in enumerate(zip(hashes2, idents2)):
            assert daemon.store.get(digest2, h, ident) == random_bytes(BLOCK_BYTES, seed=i)
        daemon.store.check_integrity()
    finally:
        daemon.stop()


def test_forced_hash_collisions_through_kvstore_serve(make_daemon, tmp_path) -> None:
    """KVSTORE_DEBUG_HASH_BITS=6: 200 keys in 64 buckets; a get is its own bytes or a miss,
    from DRAM and, after a restart, from SSD."""
    bits = 6
    env = {"KVSTORE_DEBUG_HASH_BITS": str(bits)}
    ssd_dir = tmp_path / "ssd"
    values = {b"key-%d" % i: random_bytes(2048 + i, seed=i) for i in range(200)}
    buckets = {truncate_hash(xxhash.xxh3_128_digest(k), bits) for k in values}
    daemon = make_daemon(dram="4MiB", ssd_dir=ssd_dir, ssd_size="32MiB", env=env)
    with daemon.client() as c:
        for key, value in values.items():  # a put into a taken bucket replaces its block
            c.put(key, value)
    for tier in ("dram", "ssd"):
        if tier == "ssd":  # a graceful restart: everything is served from SSD now
            assert daemon.stop() == 0
            daemon = make_daemon(dram="4MiB", ssd_dir=ssd_dir, ssd_size="32MiB", env=env)
        with daemon.client() as c:
            served = 0
            for key, value in values.items():
                got = c.get(key)
                assert got is None or got == value, f"{tier}: {key!r} has another key's bytes"
                served += got is not None
            assert served == len(buckets) < len(values)  # one survivor per bucket
            counters = c.stats()["counters"]
            assert counters["collisions"] == len(values) - served  # each miss was a collision
            assert counters[f"hit_blocks_{tier}"] == served


def _colliding_chain(bucket_of: set[bytes], bits: int) -> tuple[bytes, list, list, np.ndarray]:
    """A one-block chain of BASE whose hash, cut to ``bits``, lands in a taken bucket."""
    digest = BASE.digest
    rng = np.random.default_rng(99)
    while True:
        tokens = rng.integers(0, 50_000, 16)
        h = block_hashes(digest, tokens, 16)[0]
        if truncate_hash(h, bits) in bucket_of:
            return digest, [h], [block_ident(digest, tokens)], tokens


@pytest.mark.parametrize("tier", ["dram", "ssd"])
def test_forced_block_collision_is_a_miss_on_every_tier(arenas, tmp_path, tier) -> None:
    bits = 6
    config = StoreConfig(dram_bytes=8 << 20, ssd_dir=tmp_path / "ssd", ssd_bytes=32 << 20,
                         debug_hash_bits=bits)
    src = arenas(8, BLOCK_BYTES, seed=21)
    dst = arenas(8, BLOCK_BYTES, seed=None)
    digest, hashes, idents = _chain(BASE)
    daemon = InProcessDaemon(config)
    with daemon.client() as c:
        reg = c.register(src.layout, "a")
        assert c.save(reg, digest, range(NUM_BLOCKS), hashes, idents).num_saved == NUM_BLOCKS
    if tier == "ssd":  # only the SSD copies are left after the restart
        assert daemon.store.flush_to_ssd() == NUM_BLOCKS
        daemon.stop()
        daemon = InProcessDaemon(config)
    try:
        buckets = {truncate_hash(h, bits): i for i, h in enumerate(hashes)}
        other, other_hashes, other_idents, _ = _colliding_chain(set(buckets), bits)
        victim = buckets[truncate_hash(other_hashes[0], bits)]
        with daemon.client() as c:
            reg_src, reg_dst = c.register(src.layout, "b"), c.register(dst.layout, "dst")
            # Looked up under another chain's ident, the stored block in that bucket is a miss.
            hit = c.lookup(other, other_hashes, other_idents)
            assert hit.num_hit == 0 and hit.lease_id is None
            assert daemon.store.stats()["counters"]["collisions"] == 1
            # Storing the colliding block replaces the old one (newest wins): afterwards each
            # chain reads only its own bytes, and the replaced block is a miss for its chain.
            assert c.save(reg_src, other, [7], other_hashes, other_idents).num_saved == 1
            hit = c.lookup(other, other_hashes, other_idents)
            assert hit.num_hit == 1 and c.load(reg_dst, hit.lease_id, [0]) == 1
            assert dst.block(0) == src.block(7)
            hit = c.lookup(digest, hashes, idents)
            assert hit.num_hit == victim
            if victim:
                assert c.load(reg_dst, hit.lease_id, range(victim)) == victim
                assert [dst.block(i) for i in range(victim)] == \
                    [src.block(i) for i in range(victim)]
        daemon.store.check_integrity()
    finally:
        daemon.stop()
