"""The fast whole-prompt hashing paths equal the one-block-at-a-time definitions."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.keys import (
    Namespace,
    block_hash,
    block_ident,
    chain_hashes,
    encode_tokens,
    ident_from_bytes,
)


@pytest.mark.parametrize("bits", [None, 16, 5])
@pytest.mark.parametrize("num_tokens", [0, 15, 16, 17, 160, 1000])
def test_chain_hashes_equal_block_by_block(bits: int | None, num_tokens: int) -> None:
    tokens = np.random.default_rng(num_tokens).integers(0, 150_000, num_tokens)
    digest = Namespace(name="chain").digest
    expect, parent = [], digest
    for i in range(num_tokens // 16):
        parent = block_hash(parent, tokens[i * 16:(i + 1) * 16], debug_hash_bits=bits)
        expect.append(parent)
    assert chain_hashes(digest, encode_tokens(tokens), 16, debug_hash_bits=bits) == expect


def test_ident_from_bytes_equals_block_ident() -> None:
    tokens = np.arange(32)
    data = encode_tokens(tokens)
    parent = bytes(range(16))
    assert ident_from_bytes(parent, data[64:128]) == block_ident(parent, tokens[16:32])
