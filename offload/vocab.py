"""The store's vocabulary the engine speaks: block keys, namespaces and the arena layout.

The engine never imports ``kvstore``; what it shares with the store (the chained block hashes its
prefix cache keys blocks by and the idents that prove them, the int32-LE token encoding they are
made of, how many blocks of a prompt a cache may serve, the model identity and tenant namespace
that salt them, the layout a KV arena is registered with, the tiers usage counts cached tokens by)
comes through here, so both sides hash and describe blocks with the very same code
(``kvstore.keys``, ``kvstore.layout``).
"""

from __future__ import annotations

from kvstore import Tier
from kvstore.keys import (
    TOKEN_ID_BYTES,
    ModelIdentity,
    Namespace,
    block_token_bytes,
    chain_hashes,
    chain_idents,
    encode_tokens,
    ident_from_bytes,
    servable_blocks,
)
from kvstore.layout import GENERATION_BYTES, GENERATION_DTYPE, KVLayout, Region

__all__ = [
    "GENERATION_BYTES", "GENERATION_DTYPE", "TOKEN_ID_BYTES", "KVLayout", "ModelIdentity",
    "Namespace", "Region", "Tier", "block_token_bytes", "chain_hashes", "chain_idents",
    "encode_tokens", "ident_from_bytes", "servable_blocks",
]
