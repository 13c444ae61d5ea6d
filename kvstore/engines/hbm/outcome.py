"""BlockOutcome: why a block an engine's arena holds was not moved, or what became of it.

One vocabulary for both users of an arena's blocks: HBM-tier copies into another engine's arena
(``copy.py``: a copy stops short at the first block that fails, for one of these reasons) and
stages into the store for a peer node (``staging.py``: every block ends in one of them). The
owner reallocating a block, the owner going away, a CUDA error: the same event is the same member
for both, and each user counts it under its own counter.
"""

from __future__ import annotations

import enum


class BlockOutcome(str, enum.Enum):
    """What became of one block a copy or a stage tried to move."""

    STAGED = "staged"  # a stage copied it from the arena and committed it to the store
    STORED = "stored"  # a stage found it in the store already (a save landed meanwhile)
    GENERATION = "generation"  # the owner reallocated it during the copy: nothing of it counts
    OWNER_CLOSED = "owner_closed"  # the owner unregistered or its connection closed
    INCOMPATIBLE = "incompatible"  # other block pieces, other device kind, no peer access
    COPY_ERROR = "copy_error"  # the copy failed (CUDA reported an error)
    STOPPED = "stopped"  # the requester's deadline passed or it disconnected
    STORE_REFUSED = "store_refused"  # the store had no room (every byte pinned)

    def __str__(self) -> str:
        return self.value
