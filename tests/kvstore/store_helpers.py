"""Shared bits of the storage-core tests: a namespace and deterministic blocks."""

from __future__ import annotations

import numpy as np

from kvstore.keys import Namespace, block_hash, block_ident

NS = Namespace(name="store-tests").digest


def block_bytes(i: int, num_bytes: int) -> bytes:
    """Distinct, reproducible bytes for block ``i`` (any process computes the same)."""
    return np.random.default_rng([7, i]).integers(0, 256, num_bytes, dtype=np.uint8).tobytes()


def block_key(i: int, debug_hash_bits: int | None = None) -> tuple[bytes, bytes]:
    """(block hash, ident) of a one-block chain whose tokens are ``[i] * 16``."""
    tokens = [i] * 16
    return block_hash(NS, tokens, debug_hash_bits=debug_hash_bits), block_ident(NS, tokens)
