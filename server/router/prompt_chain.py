"""PromptChain: a prompt's block chain as the engine keys it in the store, for the router.

The engine salts its block keys with a namespace (its model identity plus the request's tenant
salt) and chains an XXH3-128 hash per full block of the prompt; an ident (parent hash + tokens)
proves each block. The router builds the very same chain from the identity an engine reports on
``GET /load`` (``server/load_report.py``), with the same functions (``offload.vocab``, i.e.
``kvstore.keys``), so the daemon's ``locate`` of it answers for the engine's own blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore import MAX_LOCATE_BLOCKS
from offload.vocab import (
    ModelIdentity,
    Namespace,
    chain_hashes,
    chain_idents,
    encode_tokens,
    servable_blocks,
)


def routed_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading blocks of a prompt the router looks up: the full blocks that leave at
    least one token to compute (as an engine's prefix cache does), at most MAX_LOCATE_BLOCKS
    (the longest chain the daemon's ``locate`` takes)."""
    return min(servable_blocks(num_tokens, block_size), MAX_LOCATE_BLOCKS)


@dataclass(frozen=True)
class KVIdentity:
    """What an engine's block keys are made from, apart from the tenant: its model identity
    and block size (engines with equal identities share blocks)."""

    model: ModelIdentity
    block_size: int

    @classmethod
    def from_report(cls, model_identity: Mapping[str, Any], block_size: int) -> KVIdentity:
        """From /load's ``model_identity`` and ``block_size``; ValueError if unusable."""
        try:
            model = ModelIdentity(**model_identity)
        except TypeError as exc:
            raise ValueError(f"unusable model identity {dict(model_identity)!r}: {exc}") from None
        if model.block_size != block_size:
            raise ValueError(f"block size {block_size} differs from the identity's "
                             f"{model.block_size}")
        return cls(model, block_size)

    def namespace(self, tenant_salt: str) -> bytes:
        """The namespace digest of a tenant, as ``LLMEngine.namespace(salt).digest``."""
        return Namespace(model=self.model, tenant_salt=tenant_salt).digest


@dataclass(frozen=True)
class PromptChain:
    """The hashes and idents of a prompt's full blocks under one namespace."""

    namespace: bytes
    hashes: list[bytes]
    idents: list[bytes]
    block_size: int

    @classmethod
    def of(cls, identity: KVIdentity, token_ids: Sequence[int], tenant_salt: str) -> PromptChain:
        """The chain the engine would look up for this prompt: its full blocks, leaving at
        least one token to compute (as the engine's prefix cache does), at most
        MAX_LOCATE_BLOCKS of them (the longest chain the daemon's ``locate`` takes)."""
        block_size = identity.block_size
        blocks = range(routed_blocks(len(token_ids), block_size))
        namespace = identity.namespace(tenant_salt)
        token_bytes = encode_tokens(token_ids[:len(blocks) * block_size])
        hashes = chain_hashes(namespace, token_bytes, block_size, blocks)
        return cls(namespace, hashes, chain_idents(namespace, token_bytes, block_size, blocks,
                                                   hashes), block_size)

    def __len__(self) -> int:
        return len(self.hashes)
