"""The daemon's CPU data path: save and load for a shared-memory registration, block by block.

A save reserves a store slot per block, copies the engine's block into it and publishes it only
after the copy; a load reads each leased block (promoting SSD ones) and copies it into the
engine's block, then hands it back (``done``) so a lease larger than DRAM is promoted piece by
piece. ``check()`` runs between blocks and raises once the request is cancelled: a cancelled
call stops writing at the next block boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvstore.store.block_store import BlockStore, Lease, StoreError

if TYPE_CHECKING:  # the registration calls these functions: no import at run time
    from kvstore.engines.shm_registration import ShmRegistration


def save_blocks(store: BlockStore, reg: ShmRegistration, namespace: bytes,
                block_ids: Sequence[int], hashes: Sequence[bytes], idents: Sequence[bytes],
                check: Callable[[], None], outcomes: list[str]) -> None:
    """Append one outcome per block to ``outcomes``: saved, duplicate or failed."""
    num_bytes = reg.block_bytes
    for block_id, block_hash, ident in zip(block_ids, hashes, idents):
        check()
        outcomes.append(_save_one(store, reg, namespace, block_id, block_hash, ident,
                                  num_bytes))


def _save_one(store: BlockStore, reg: ShmRegistration, namespace: bytes, block_id: int,
              block_hash: bytes, ident: bytes, num_bytes: int) -> str:
    try:
        slot = store.begin_write(namespace, block_hash, ident, num_bytes)
    except StoreError:
        return "failed"
    if slot is None:
        return "duplicate"
    try:
        reg.read_block(block_id, slot.buffer[:num_bytes])
    except BaseException:
        slot.abort()
        raise
    return "saved" if slot.commit() else "duplicate"


def load_blocks(store: BlockStore, reg: ShmRegistration, lease: Lease, first_index: int,
                block_ids: Sequence[int], check: Callable[[], None]) -> int:
    """Copy the lease's blocks ``first_index, ...`` into ``block_ids``; stops at the first
    unavailable block (fail closed: only blocks whose bytes fully arrived are counted)."""
    num_loaded = 0
    for index, block_id in enumerate(block_ids, first_index):
        check()
        try:
            data = store.read(lease, index)
        except StoreError:  # BlockUnavailable included: the hit shrinks here
            break
        if data.nbytes != reg.block_bytes:
            break  # stored under another layout; never copy a partial block
        reg.write_block(block_id, data)  # returns once the copy is done
        store.done(lease, index)  # its DRAM may go to the next promotion
        num_loaded += 1
    return num_loaded
