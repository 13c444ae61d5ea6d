"""One chain of block keys: the engine's prefix cache, the vLLM connector and the router key the
same prompt with the same bytes, and those bytes are DESIGN.md's definition.

Each path is compared with a reference written here from the definition alone (``h_i =
XXH3-128(h_{i-1} || token ids of block i as little-endian int32)``, ``h_{-1}`` the namespace
digest; an ident is the parent hash, the u32-LE length of the token bytes, the token bytes), not
with another path: a path that drifts by one byte fails its own assertion, and so does a drift of
the shared derivation in ``kvstore.keys`` that every path calls. A router whose chain is not the
engine's would route every request to a miss without an error anywhere."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from block_simulation import make_seq

from engine.block_manager import BlockManager
from kvstore.keys import ModelIdentity
from offload.external.block_keys import KeyMaker
from offload.idents import sequence_idents
from offload.vllm.model_identity import vllm_identity
from offload.vocab import ident_from_bytes
from server.router.prompt_chain import KVIdentity, PromptChain

SALT = "tenant-a"


def _identity(block_size: int) -> ModelIdentity:
    return vllm_identity(architecture="Qwen3ForCausalLM", num_layers=4, num_kv_heads=2,
                         head_dim=8, kv_dtype="bfloat16", block_size=block_size,
                         weights_id="w", kv_format="cpu:LBHNC")


def _reference(namespace: bytes, token_ids: list[int], block_size: int,
               num_blocks: int) -> tuple[list[bytes], list[bytes]]:
    """Hashes and idents of the first ``num_blocks`` blocks, from the definition alone."""
    hashes, idents, parent = [], [], namespace
    for i in range(num_blocks):
        block = struct.pack(f"<{block_size}i", *token_ids[i * block_size:(i + 1) * block_size])
        idents.append(parent + struct.pack("<I", len(block)) + block)
        parent = xxhash.xxh3_128_digest(parent + block)
        hashes.append(parent)
    return hashes, idents


def _served(num_tokens: int, block_size: int) -> int:
    """The blocks a prompt may be served from a cache: its last token is always computed."""
    return max(0, (num_tokens - 1) // block_size)


def _engine(namespace: bytes, token_ids: list[int], block_size: int,
            debug_hash_bits: int | None) -> tuple[list[bytes], list[bytes], list[bytes], int]:
    """The engine's path: a prefill registers the prompt's blocks, a second request with the
    same prompt is matched against them. Returns, over the blocks that may be served: the
    full-strength chain (what the store and the router see), the idents a restore sends the
    store, the idents of the registered blocks (as the HBM tier and the evict policy send them),
    and the number of blocks the second request hit."""
    bm = BlockManager(num_blocks=64, block_size=block_size, debug_hash_bits=debug_hash_bits)
    first = make_seq("first", token_ids, namespace)
    assert bm.admit(first, bm.match_prefix(first), len(token_ids))
    first.num_computed_tokens = len(token_ids)
    bm.register_computed_blocks(first)
    second = make_seq("second", token_ids, namespace)
    num_hit = len(bm.match_prefix(second))
    served = range(_served(len(token_ids), block_size))
    registered = dict(bm.cached_items())
    cached = [registered[first.block_ids[j]] for j in served]
    return (second.block_checks[:len(served)], sequence_idents(second, served, block_size),
            [ident_from_bytes(c.parent_check, c.token_bytes) for c in cached], num_hit)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("extra_tokens", [-15, -1, 0, 1, 7])
@pytest.mark.parametrize("debug_hash_bits", [None, 64])  # 64: keys apart from checks
def test_engine_vllm_connector_and_router_key_a_prompt_alike(
        block_size: int, extra_tokens: int, debug_hash_bits: int | None) -> None:
    num_tokens = 4 * block_size + extra_tokens
    token_ids = np.random.default_rng(num_tokens).integers(0, 150_000, num_tokens).tolist()
    num_served = _served(num_tokens, block_size)
    identity = _identity(block_size)

    vllm_keys = KeyMaker(identity)
    namespace = vllm_keys.namespace(SALT, None)
    router = PromptChain.of(KVIdentity(identity, block_size), token_ids, SALT)
    assert router.namespace == namespace  # one namespace, or nothing below could agree
    vllm = vllm_keys.keys(token_ids, SALT, num_blocks=num_served)
    engine_hashes, engine_idents, cached_idents, num_hit = _engine(
        namespace, token_ids, block_size, debug_hash_bits)

    hashes, idents = _reference(namespace, token_ids, block_size, num_served)
    assert len(hashes) == num_served and (num_served > 0) == (num_tokens > block_size)
    assert engine_hashes == hashes and engine_idents == idents and cached_idents == idents
    assert num_hit == num_served  # the engine's own cache serves what the others would ask for
    assert vllm.hashes == hashes and vllm.idents == idents
    assert router.hashes == hashes and router.idents == idents


@pytest.mark.parametrize("debug_hash_bits", [None, 64])
def test_a_chain_grown_token_by_token_is_the_whole_prompts(debug_hash_bits: int | None) -> None:
    """The engine extends a sequence's chain every step from its last key (decode): the same
    links as the prompt keyed at once by the router."""
    block_size, num_tokens = 4, 23
    token_ids = list(range(500, 500 + num_tokens))
    identity = _identity(block_size)
    namespace = KeyMaker(identity).namespace(SALT, None)
    bm = BlockManager(num_blocks=16, block_size=block_size, debug_hash_bits=debug_hash_bits)
    seq = make_seq("grown", token_ids[:1], namespace)
    for token in token_ids[1:]:
        seq.token_ids.append(token)
        bm.update_hashes(seq)
    hashes, _ = _reference(namespace, token_ids, block_size, num_tokens // block_size)
    assert seq.block_checks == hashes
    assert (seq.block_hashes == hashes) == (debug_hash_bits is None)
    # One token more and the router, like the engine, may serve every full block.
    router = PromptChain.of(KVIdentity(identity, block_size), token_ids + [1], SALT)
    assert router.hashes == hashes
