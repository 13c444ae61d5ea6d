"""Block keys: deterministic across processes, typed namespace fields, and truncated-hash safety."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from store_helpers import NS, block_bytes

from kvstore.keys import (
    ModelIdentity,
    Namespace,
    block_hash,
    block_hashes,
    block_ident,
    encode_fields,
    shard_namespace,
    truncate_hash,
)

MODEL = ModelIdentity("Qwen3ForCausalLM", num_layers=36, num_kv_heads=8, head_dim=128,
                      kv_dtype="bfloat16", block_size=16, weights_id="sha256:abc")
TOKENS = list(range(1000, 1040))  # two full blocks and a partial one

_CHILD = """
import json, sys
from kvstore.keys import ModelIdentity, Namespace, block_hashes
m = ModelIdentity("Qwen3ForCausalLM", 36, 8, 128, "bfloat16", 16, "sha256:abc")
ns = Namespace(model=m, tenant_salt="acme", lora_id="l1")
print(json.dumps({"ns": ns.digest.hex(),
                  "hashes": [h.hex() for h in block_hashes(ns.digest, range(1000, 1040), 16)]}))
"""


def _field(tag: int, kind: int, payload: bytes) -> bytes:
    return struct.pack("<BBI", tag, kind, len(payload)) + payload


def test_two_processes_compute_identical_hashes():
    ns = Namespace(model=MODEL, tenant_salt="acme", lora_id="l1")
    mine = {"ns": ns.digest.hex(), "hashes": [h.hex() for h in block_hashes(ns.digest, TOKENS, 16)]}
    outs = []
    for seed in ("1", "2"):  # a different PYTHONHASHSEED: nothing may depend on hash()
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                              text=True, check=True, timeout=60)
        outs.append(json.loads(proc.stdout))
    assert outs[0] == outs[1] == mine
    assert len(mine["hashes"]) == 2  # the partial third block gets no hash


def test_namespace_encoding_matches_the_spec():
    # Namespace() is the scheme version then empty tenant, LoRA and name, each typed + sized.
    expected = (_field(1, 1, struct.pack("<q", 1)) + _field(10, 2, b"") + _field(11, 2, b"")
                + _field(12, 2, b""))
    assert Namespace().encode() == expected
    assert Namespace().digest == xxhash.xxh3_128_digest(expected)
    assert Namespace().digest.hex() == "18634621e776d3e4daca5fc31dfc0605"  # frozen: scheme v1
    assert encode_fields([(10, "x")]) == b"\x0a\x02\x01\x00\x00\x00x"


def test_block_hash_chain_matches_the_spec():
    parent = Namespace().digest
    tokens = np.arange(32, dtype="<i4")
    h0 = xxhash.xxh3_128_digest(parent + tokens[:16].tobytes())
    h1 = xxhash.xxh3_128_digest(h0 + tokens[16:].tobytes())
    assert block_hashes(parent, tokens, 16) == [h0, h1]
    with_extra = xxhash.xxh3_128_digest(parent + tokens[:16].tobytes() + b"\x02\x00\x00\x00mm")
    assert block_hash(parent, tokens[:16], extra=b"mm") == with_extra


def test_same_text_in_different_fields_gives_different_namespaces():
    digests = {
        "tenant": Namespace(tenant_salt="x").digest,
        "lora": Namespace(lora_id="x").digest,
        "name": Namespace(name="x").digest,
        "none": Namespace().digest,
        "model+tenant": Namespace(model=MODEL, tenant_salt="x").digest,
        "model+lora": Namespace(model=MODEL, lora_id="x").digest,
    }
    assert len(set(digests.values())) == len(digests)
    # Length prefixes keep field boundaries: "ab"+"" is not "a"+"b".
    assert Namespace(tenant_salt="ab").digest != Namespace(tenant_salt="a", lora_id="b").digest
    # Typed: the string "1" and the int 1 differ even under the same tag.
    assert encode_fields([(10, "1")]) != encode_fields([(10, 1)])


def test_model_identity_changes_the_namespace():
    other = ModelIdentity("Qwen3ForCausalLM", 36, 8, 128, "float16", 16, "sha256:abc")
    assert Namespace(model=MODEL).digest != Namespace(model=other).digest


def test_shard_namespaces_follow_the_spec_and_never_meet():
    ns = Namespace(model=MODEL).digest
    assert shard_namespace(ns, 0, 1) == ns  # one rank: the keys of an engine without shards
    expected = xxhash.xxh3_128_digest(_field(13, 3, ns) + _field(14, 1, struct.pack("<q", 1))
                                      + _field(15, 1, struct.pack("<q", 2)))
    assert shard_namespace(ns, 1, 2) == expected
    shards = {(s, n): shard_namespace(ns, s, n) for n in (1, 2, 4) for s in range(n)}
    other = shard_namespace(Namespace(model=MODEL, tenant_salt="x").digest, 0, 2)
    assert len(set(shards.values()) | {other}) == len(shards) + 1
    for shard, num_shards in [(2, 2), (-1, 2), (0, 0)]:
        with pytest.raises(ValueError, match="shard"):
            shard_namespace(ns, shard, num_shards)
    with pytest.raises(ValueError, match="16 bytes"):
        shard_namespace(b"short", 0, 2)


def test_truncated_hashes_keep_only_the_low_bits():
    full = block_hash(NS, [1] * 16)
    short = block_hash(NS, [1] * 16, debug_hash_bits=16)
    assert short == truncate_hash(full, 16)
    assert int.from_bytes(short, "little") == int.from_bytes(full, "little") & 0xFFFF
    assert truncate_hash(full, None) == full


def _collision_run(make_store, client_bits: int | None, store_bits: int | None) -> None:
    """3,000 blocks whose 16-bit hashes collide: every read is its own bytes or a miss."""
    num_blocks, size = 3000, 64
    blocks = []
    for i in range(num_blocks):
        tokens = [i, i + 1] * 8
        h = block_hash(NS, tokens, debug_hash_bits=client_bits)
        blocks.append((h, block_ident(NS, tokens), block_bytes(i, size)))
    effective = {truncate_hash(h, 16) for h, _, _ in blocks}
    assert len(effective) < num_blocks - 20  # collisions really happen (birthday: ~68 expected)

    store = make_store(dram_bytes=num_blocks * 4096, debug_hash_bits=store_bits)
    for h, ident, data in blocks:
        store.put(NS, h, ident, data)
    served = missed = 0
    for h, ident, data in blocks:
        got = store.get(NS, h, ident)
        if got is None:
            missed += 1
        else:
            assert got == data  # never another block's bytes
            served += 1
    counters = store.stats()["counters"]
    assert served == len(effective)  # nothing was evicted: exactly one block per hash survives
    assert missed == num_blocks - len(effective)
    assert counters["collisions"] == missed  # every miss was an ident mismatch, counted
    store.check_integrity()


def test_truncated_client_hashes_collide_as_misses(make_store):
    _collision_run(make_store, client_bits=16, store_bits=None)


def test_store_debug_hash_bits_collide_as_misses(make_store):
    _collision_run(make_store, client_bits=None, store_bits=16)


def test_collision_inside_a_chain_stops_the_prefix(make_store):
    store = make_store(dram_bytes=1 << 20, debug_hash_bits=8)
    tokens_a = list(range(64))
    hashes = block_hashes(NS, tokens_a, 16)
    idents = [block_ident(p, tokens_a[i * 16:(i + 1) * 16])
              for i, p in enumerate([NS, *hashes[:-1]])]
    for i, (h, ident) in enumerate(zip(hashes, idents)):
        store.put(NS, h, ident, block_bytes(i, 100))
    # A different chain whose third block lands on the same 8-bit key as a stored block.
    forged = list(idents)
    forged[2] = b"someone else's tokens"
    result = store.lookup(NS, hashes, forged, lease_ttl_s=None)
    assert result.num_hit == 2 and result.lease is None
    assert store.stats()["counters"]["collisions"] == 1
    assert store.lookup(NS, hashes, idents, lease_ttl_s=None).num_hit == 4
