"""Block keys: the namespace digest and the chained XXH3-128 block hashes.

A namespace is encoded as typed, length-prefixed fields (tag, type, u32 length, payload) so that no
two fields can be confused: a tenant salt "x" and a LoRA id "x" give different digests. A block hash
is ``h_i = XXH3-128(h_{i-1} || token ids of block i as little-endian int32 || extra keys)`` with
``h_{-1}`` the namespace digest. Everything here is deterministic across processes and machines.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

HASH_SCHEME_VERSION = 1
KV_LAYOUT_VERSION = 1
HASH_BYTES = 16
TOKEN_ID_BYTES = 4  # every key and ident holds a token id as int32-LE

# A prompt's tokens, as ids or as the int32-LE bytes ``encode_tokens`` makes of them.
Tokens = Sequence[int] | np.ndarray | bytes

# Field tags of the namespace encoding; never reuse or renumber one.
_TAG_SCHEME = 1
_TAG_ARCH = 2
_TAG_NUM_LAYERS = 3
_TAG_NUM_KV_HEADS = 4
_TAG_HEAD_DIM = 5
_TAG_KV_DTYPE = 6
_TAG_BLOCK_SIZE = 7
_TAG_LAYOUT = 8
_TAG_WEIGHTS = 9
_TAG_TENANT = 10
_TAG_LORA = 11
_TAG_NAME = 12
_TAG_SHARD_OF = 13
_TAG_SHARD = 14
_TAG_NUM_SHARDS = 15

_TYPE_INT = 1
_TYPE_STR = 2
_TYPE_BYTES = 3


def _field(tag: int, value: int | str | bytes) -> bytes:
    if isinstance(value, bool):
        raise TypeError("booleans are not namespace fields")
    if isinstance(value, int):
        kind, payload = _TYPE_INT, struct.pack("<q", value)
    elif isinstance(value, str):
        kind, payload = _TYPE_STR, value.encode("utf-8")
    elif isinstance(value, bytes):
        kind, payload = _TYPE_BYTES, value
    else:
        raise TypeError(f"unsupported namespace field type {type(value).__name__}")
    return struct.pack("<BBI", tag, kind, len(payload)) + payload


def encode_fields(fields: Iterable[tuple[int, int | str | bytes]]) -> bytes:
    """Encode (tag, value) pairs as typed, length-prefixed fields, in the given order."""
    return b"".join(_field(tag, value) for tag, value in fields)


@dataclass(frozen=True)
class ModelIdentity:
    """What makes two engines' KV interchangeable: same identity, same bytes for the same tokens."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    block_size: int
    weights_id: str
    kv_layout_version: int = KV_LAYOUT_VERSION

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelIdentity.{name} must be positive")


@dataclass(frozen=True)
class Namespace:
    """A model identity plus tenant salt, LoRA id and hash-scheme version; ``digest`` is its key."""

    model: ModelIdentity | None = None
    tenant_salt: str = ""
    lora_id: str = ""
    name: str = ""  # the bytes API's free-form namespace ("default")
    hash_scheme_version: int = HASH_SCHEME_VERSION

    def encode(self) -> bytes:
        fields: list[tuple[int, int | str | bytes]] = [(_TAG_SCHEME, self.hash_scheme_version)]
        if self.model is not None:
            m = self.model
            fields += [
                (_TAG_ARCH, m.architecture),
                (_TAG_NUM_LAYERS, m.num_layers),
                (_TAG_NUM_KV_HEADS, m.num_kv_heads),
                (_TAG_HEAD_DIM, m.head_dim),
                (_TAG_KV_DTYPE, m.kv_dtype),
                (_TAG_BLOCK_SIZE, m.block_size),
                (_TAG_LAYOUT, m.kv_layout_version),
                (_TAG_WEIGHTS, m.weights_id),
            ]
        fields += [(_TAG_TENANT, self.tenant_salt), (_TAG_LORA, self.lora_id),
                   (_TAG_NAME, self.name)]
        return encode_fields(fields)

    @property
    def digest(self) -> bytes:
        return xxhash.xxh3_128_digest(self.encode())


def shard_namespace(namespace_digest: bytes, shard: int, num_shards: int) -> bytes:
    """The namespace under which one shard of a model-parallel engine keeps its part of each
    block (tensor parallelism: every rank holds other heads of the same tokens). The block
    hashes and idents stay those of ``namespace_digest``'s chain, so every shard's keys come from
    one computation. One shard: ``namespace_digest`` itself."""
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} of {num_shards}: need 0 <= shard < num_shards")
    if len(namespace_digest) != HASH_BYTES:
        raise ValueError(f"a namespace digest has {HASH_BYTES} bytes, not {len(namespace_digest)}")
    if num_shards == 1:
        return namespace_digest
    return xxhash.xxh3_128_digest(encode_fields([(_TAG_SHARD_OF, namespace_digest),
                                                 (_TAG_SHARD, shard),
                                                 (_TAG_NUM_SHARDS, num_shards)]))


def truncate_hash(digest: bytes, bits: int | None) -> bytes:
    """Keep only the low ``bits`` bits of a 16-byte hash (a debug weakening; None keeps all)."""
    if bits is None or bits >= 128:
        return digest
    value = int.from_bytes(digest, "little") & ((1 << bits) - 1)
    return value.to_bytes(HASH_BYTES, "little")


def encode_tokens(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as the little-endian int32 bytes that block hashes and idents are made of."""
    return np.asarray(token_ids, dtype="<i4").tobytes()


def servable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a prompt of ``num_tokens`` a cache may serve: its last
    token is always computed (the step samples from its logits), so a prompt of exactly n
    blocks is served at most n - 1. Every engine, connector and router asks this, not itself."""
    return max(0, (num_tokens - 1) // block_size)


def block_token_bytes(token_bytes: bytes, block_size: int, blocks: Iterable[int]) -> list[bytes]:
    """The int32-LE bytes of each block in ``blocks`` of ``token_bytes`` (token 0 first)."""
    step = TOKEN_ID_BYTES * block_size
    return [token_bytes[j * step:(j + 1) * step] for j in blocks]


def block_hash(
    parent: bytes, token_ids: Sequence[int] | np.ndarray, extra: bytes = b"",
    debug_hash_bits: int | None = None,
) -> bytes:
    """One link of the chain: XXH3-128(parent || int32-LE tokens || len-prefixed extra keys)."""
    if len(parent) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    tokens = encode_tokens(token_ids)
    tail = struct.pack("<I", len(extra)) + extra if extra else b""
    return truncate_hash(xxhash.xxh3_128_digest(parent + tokens + tail), debug_hash_bits)


def _as_token_bytes(tokens: Tokens, num_tokens: int) -> bytes:
    """``tokens`` as int32-LE bytes covering at least its first ``num_tokens`` tokens."""
    if not isinstance(tokens, bytes):
        tokens = encode_tokens(tokens[:num_tokens])
    if len(tokens) < TOKEN_ID_BYTES * num_tokens:
        raise ValueError(f"{len(tokens) // TOKEN_ID_BYTES} tokens do not cover {num_tokens}")
    return tokens


def chain_hashes(
    namespace: bytes, tokens: Tokens, block_size: int, blocks: range | None = None,
    parent: bytes | None = None, debug_hash_bits: int | None = None,
) -> list[bytes]:
    """The chain keys of blocks ``blocks`` (default: every full block) of a prompt's tokens (ids,
    or int32-LE bytes from token 0 on, as ``encode_tokens`` makes them): block j's key is
    ``XXH3-128(key of block j-1 || its tokens)``, block 0's parent the namespace digest. This is
    the one derivation of block keys: the engine's prefix cache, the store links, the vLLM
    connector and the router all call it. ``parent`` is the key of block ``blocks.start - 1``
    when the caller has it (extending a chain); without it that key is computed first. With
    ``debug_hash_bits`` every link is truncated, parents included (a debug weakening)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if blocks is None:
        num_tokens = len(tokens) // TOKEN_ID_BYTES if isinstance(tokens, bytes) else len(tokens)
        blocks = range(num_tokens // block_size)
    if blocks.step != 1:
        raise ValueError(f"a chain is computed over consecutive blocks, not {blocks}")
    if not blocks:
        return []
    token_bytes = _as_token_bytes(tokens, blocks.stop * block_size)
    if parent is None:
        parent = namespace
        if blocks.start > 0:
            parent = chain_hashes(namespace, token_bytes, block_size, range(blocks.start),
                                  debug_hash_bits=debug_hash_bits)[-1]
    if len(parent) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    step = TOKEN_ID_BYTES * block_size
    digest = xxhash.xxh3_128_digest
    out: list[bytes] = []
    for start in range(blocks.start * step, blocks.stop * step, step):
        parent = digest(parent + token_bytes[start:start + step])
        if debug_hash_bits is not None:
            parent = truncate_hash(parent, debug_hash_bits)
        out.append(parent)
    return out


def chain_idents(
    namespace: bytes, tokens: Tokens, block_size: int, blocks: Sequence[int],
    checks: Sequence[bytes],
) -> list[bytes]:
    """The idents of blocks ``blocks`` (ascending) of a prompt's tokens, as ``chain_hashes``
    takes them: each block's parent is the full-strength key of the block before it
    (``checks``, the chain from block 0 on; the namespace for block 0), so an ident verifies the
    whole prefix even when keys are truncated."""
    if not blocks:
        return []
    token_bytes = _as_token_bytes(tokens, (blocks[-1] + 1) * block_size)
    step = TOKEN_ID_BYTES * block_size
    size = _length_prefix(step)  # every block's the same: packed once (a lookup asks for
    # hundreds of blocks, and a pack and a call a block cost a first turn 0.2 ms)
    return [_ident(checks[j - 1] if j else namespace, size, token_bytes[j * step:(j + 1) * step])
            for j in blocks]


def block_hashes(
    namespace_digest: bytes, token_ids: Sequence[int] | np.ndarray, block_size: int,
    extras: Sequence[bytes] | None = None, debug_hash_bits: int | None = None,
) -> list[bytes]:
    """Chained hashes of every full block of ``token_ids``; a trailing partial block gets none."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if extras is None:
        return chain_hashes(namespace_digest, encode_tokens(token_ids), block_size,
                            debug_hash_bits=debug_hash_bits)
    tokens = np.asarray(token_ids, dtype="<i4")
    num_full = len(tokens) // block_size
    out: list[bytes] = []
    parent = namespace_digest
    for i in range(num_full):
        parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size], extras[i],
                            debug_hash_bits)
        out.append(parent)
    return out


def block_ident(parent: bytes, token_ids: Sequence[int] | np.ndarray, extra: bytes = b"") -> bytes:
    """What a store keeps beside a block to verify a hit: parent hash, tokens and extra keys."""
    return ident_from_bytes(parent, encode_tokens(token_ids), extra)


def ident_from_bytes(parent: bytes, block_token_bytes: bytes, extra: bytes = b"") -> bytes:
    """``block_ident`` of a block whose tokens are already int32-LE bytes."""
    return _ident(parent, _length_prefix(len(block_token_bytes)), block_token_bytes) + extra


def _length_prefix(num_bytes: int) -> bytes:
    return struct.pack("<I", num_bytes)


def _ident(parent: bytes, length_prefix: bytes, block_token_bytes: bytes) -> bytes:
    """An ident's bytes: the parent key, the tokens' length, the tokens (extra keys follow)."""
    return parent + length_prefix + block_token_bytes
