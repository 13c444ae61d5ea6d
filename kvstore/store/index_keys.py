"""The tiered store's index keys: namespace || block hash, the hash truncated in debug mode."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.keys import HASH_BYTES, truncate_hash
from kvstore.store.block_store import StoreError

BAD_SIZES = f"namespace and block hashes must be {HASH_BYTES} bytes each"


class IndexKeys:
    """Makes index keys; ``debug_hash_bits`` truncates hashes so that collisions can be forced."""

    def __init__(self, debug_hash_bits: int | None) -> None:
        self._bits = debug_hash_bits

    def key(self, namespace: bytes, block_hash: bytes) -> bytes:
        """The index key: namespace || hash (truncated in debug mode). StoreError on bad sizes."""
        if len(namespace) != HASH_BYTES or len(block_hash) != HASH_BYTES:
            raise StoreError(BAD_SIZES)
        return bytes(namespace) + self.hashes([block_hash])[0]

    def hashes(self, block_hashes: Sequence[bytes]) -> Sequence[bytes]:
        """The hashes the index is keyed by: as given, or truncated in debug mode.

        In debug mode every size is checked here (a truncated hash no longer shows it);
        otherwise ``lookup`` checks the sizes of the hashes DRAM did not find.
        """
        bits = self._bits
        if bits is None:
            return block_hashes
        if not {HASH_BYTES}.issuperset(map(len, block_hashes)):
            raise StoreError(BAD_SIZES)
        return [truncate_hash(bytes(h), bits) for h in block_hashes]
