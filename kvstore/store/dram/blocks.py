"""A DRAM block of the tiered store: its key, ident, allocation, state and pins. Plain state."""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass

from kvstore.store.allocator import Allocation


class BlockState(enum.Enum):
    IN_FLIGHT = "in_flight"  # reserved by a writer or being promoted: invisible, never evicted
    READY = "ready"


@dataclass(eq=False, slots=True)
class Block:
    key: bytes
    ident: bytes
    alloc: Allocation
    state: BlockState
    pins: int = 0  # leases holding it, plus one while a promotion fills it
    demoting: bool = False  # its bytes are being written to SSD: not freed meanwhile
    indexed: bool = True  # False: a lease's private copy (its key was taken meanwhile)


# Stands in for a block DRAM lacks in a lookup: its ident equals no ident, and it is never
# indexed (a Block, so that the lookup's attribute reads see one type).
ABSENT = Block(b"", object(), None, BlockState.IN_FLIGHT)  # type: ignore[arg-type]


def verified_len(found: list[Block], stored_idents: list, idents: list) -> int:
    """How many blocks, from the first, DRAM holds (``found``) with the idents asked for."""
    try:
        end = found.index(ABSENT)
    except ValueError:
        end = len(found)
    if stored_idents[:end] == idents[:end]:
        return end
    same = list(map(operator.eq, stored_idents[:end], idents[:end]))
    return same.index(False) if False in same else end
