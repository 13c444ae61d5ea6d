"""DRAM blocks of the tiered store: their index by key and namespace, and lazy pin counting.

A lease's DRAM blocks are pinned by the lease itself; their ``pins`` include it only once
something is about to free, evict, demote or replace a block: any code that does must call
``_count_pins_locked()`` first, under the same hold of the store's lock.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

from kvstore.allocator import Allocation
from kvstore.block_store import Lease
from kvstore.keys import HASH_BYTES
from kvstore.leases import HeldLease


class _State(enum.Enum):
    IN_FLIGHT = "in_flight"  # reserved by a writer or being promoted: invisible, never evicted
    READY = "ready"


@dataclass(eq=False, slots=True)
class _Block:
    key: bytes
    ident: bytes
    alloc: Allocation
    state: _State
    pins: int = 0  # leases holding it, plus one while a promotion fills it
    demoting: bool = False  # its bytes are being written to SSD: not freed meanwhile
    indexed: bool = True  # False: a lease's private copy (its key was taken meanwhile)


# Stands in for a block DRAM lacks in a lookup: its ident equals no ident, and it is never
# indexed (a _Block, so that the lookup's attribute reads see one type).
_ABSENT = _Block(b"", object(), None, _State.IN_FLIGHT)  # type: ignore[arg-type]
_NO_BLOCKS: dict[bytes, _Block] = {}  # never written: the READY index of an unknown namespace
_BAD_SIZES = f"namespace and block hashes must be {HASH_BYTES} bytes each"
_PROBE_BLOCKS = 32  # a lookup finds this many blocks before it looks any further


def _verified_len(found: list[_Block], stored_idents: list, idents: list) -> int:
    """How many blocks, from the first, DRAM holds (``found``) with the idents asked for."""
    try:
        end = found.index(_ABSENT)
    except ValueError:
        end = len(found)
    if stored_idents[:end] == idents[:end]:
        return end
    same = list(map(operator.eq, stored_idents[:end], idents[:end]))
    return same.index(False) if False in same else end


class DramIndex:
    """The TieredStore's DRAM-side bookkeeping; every method runs under the store's lock.

    A mixin: it uses the store's ``_blocks``, ``_ready``, ``_private``, ``_uncounted``,
    ``_leases``, ``_policy``, ``_pool``, ``_ssd``, ``_cond`` and ``_note_drop``.
    """

    def _find_ready_locked(self, namespace: bytes,
                           hashes: Sequence[bytes]) -> tuple[list[_Block], Sequence[bytes]]:
        """Each hash's READY block in DRAM, or _ABSENT; and the hashes, as bytes if need be.

        Without an SSD tier a hit cannot go past a block DRAM lacks, so the list may stop after
        the first of them: a cold miss looks at a few hashes, not at all of them.
        """
        ready = self._ready.get(namespace, _NO_BLOCKS)
        try:
            found = list(map(ready.get, hashes[:_PROBE_BLOCKS], repeat(_ABSENT)))
            if len(hashes) > _PROBE_BLOCKS and (self._ssd is not None or _ABSENT not in found):
                found += map(ready.get, hashes[_PROBE_BLOCKS:], repeat(_ABSENT))
        except TypeError:  # unhashable buffers (bytearray): look them up as bytes
            return self._find_ready_locked(namespace, [bytes(memoryview(h)) for h in hashes])
        return found, hashes

    def _drop_block_locked(self, block: _Block) -> None:
        del self._blocks[block.key]
        if block.state is _State.READY:
            self._ready_drop(block)
        self._policy.remove(block.key)
        self._pool.free(block.alloc)

    def _ready_put(self, block: _Block) -> None:
        namespace, block_hash = block.key[:HASH_BYTES], block.key[HASH_BYTES:]
        blocks = self._ready.get(namespace)
        if blocks is None:
            blocks = self._ready[namespace] = {}
        blocks[block_hash] = block

    def _ready_drop(self, block: _Block) -> None:
        namespace = block.key[:HASH_BYTES]
        blocks = self._ready[namespace]
        del blocks[block.key[HASH_BYTES:]]
        if not blocks:
            del self._ready[namespace]  # namespaces come and go (the bytes API names them)

    def _release_locked(self, lease: Lease) -> None:
        held = self._leases.pop(lease)
        if held is None:
            return
        if not held.counted:  # its DRAM blocks never left the index: record the access only
            del self._uncounted[lease.lease_id]
            touch = self._policy.touch
            for block in held.dram:
                if block is not None:
                    touch(block.key)
        else:
            for block in held.dram:
                if block is not None:
                    self._unpin_block_locked(block)
        if any(held.ssd):
            for entry in held.ssd:
                if entry is not None:
                    self._ssd.unpin(entry)
        self._cond.notify_all()

    def _count_pins_locked(self) -> None:
        """Count every lease's DRAM blocks into their ``pins``.

        Whatever reads ``pins`` to free, evict, demote or replace a block calls this first, in
        the same hold of the lock: then a block is pinned iff its ``pins`` is non-zero.
        """
        if self._uncounted:
            for held in list(self._uncounted.values()):
                self._count_lease_pins_locked(held)

    def _count_lease_pins_locked(self, held: HeldLease) -> None:
        if held.counted:
            return
        for block in held.dram:
            if block is not None:
                block.pins += 1
        held.counted = True
        del self._uncounted[held.lease.lease_id]

    def _unpin_block_locked(self, block: _Block) -> None:
        block.pins -= 1
        if block.indexed:
            # The access a leased lookup made is recorded here: the block could not be evicted
            # before, so its place in the eviction order did not matter until now.
            self._policy.touch(block.key)
        elif block.pins == 0:
            self._private.discard(block)
            self._pool.free(block.alloc)

    def _view(self, block: _Block) -> memoryview:
        return self._pool.view(block.alloc).toreadonly()
