"""The chain derivation every user calls (``chain_hashes``, ``chain_idents``,
``servable_blocks``) equals the one-block-at-a-time definitions."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.keys import (
    Namespace,
    block_hash,
    block_ident,
    block_token_bytes,
    chain_hashes,
    chain_idents,
    encode_tokens,
    ident_from_bytes,
    servable_blocks,
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


@pytest.mark.parametrize("bits", [None, 5])
def test_a_range_of_the_chain_is_a_slice_of_the_whole(bits: int | None) -> None:
    tokens = np.random.default_rng(3).integers(0, 150_000, 100)
    digest = Namespace(name="range").digest
    whole = chain_hashes(digest, tokens, 16, debug_hash_bits=bits)
    assert len(whole) == 6 and whole == chain_hashes(digest, encode_tokens(tokens), 16,
                                                     range(6), debug_hash_bits=bits)
    # Continued from the key before the range, or computed from the namespace without it.
    assert chain_hashes(digest, tokens, 16, range(2, 5), whole[1], bits) == whole[2:5]
    assert chain_hashes(digest, tokens, 16, range(2, 5), debug_hash_bits=bits) == whole[2:5]
    assert chain_hashes(digest, tokens, 16, range(3, 3)) == []
    with pytest.raises(ValueError):
        chain_hashes(digest, tokens, 16, range(7))  # 100 tokens hold six full blocks
    with pytest.raises(ValueError):
        chain_hashes(digest, tokens, 16, range(0, 6, 2))


def test_chain_idents_are_block_idents_with_the_full_strength_parent() -> None:
    tokens = np.arange(80)
    digest = Namespace(name="idents").digest
    checks = chain_hashes(digest, tokens, 16)
    expect = [block_ident(checks[j - 1] if j else digest, tokens[j * 16:(j + 1) * 16])
              for j in range(5)]
    assert chain_idents(digest, tokens, 16, range(5), checks) == expect
    assert chain_idents(digest, encode_tokens(tokens), 16, [1, 3], checks) == [expect[1],
                                                                              expect[3]]
    assert block_token_bytes(encode_tokens(tokens), 16, [0, 4]) == [encode_tokens(tokens[:16]),
                                                                    encode_tokens(tokens[64:])]


@pytest.mark.parametrize(("num_tokens", "served"),
                         [(0, 0), (1, 0), (16, 0), (17, 1), (32, 1), (33, 2)])
def test_a_prompts_last_token_is_never_served(num_tokens: int, served: int) -> None:
    assert servable_blocks(num_tokens, 16) == served
