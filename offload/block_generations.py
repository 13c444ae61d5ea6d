"""An engine's block generations: one uint64 counter per block id, in POSIX shared memory.

The engine bumps a block's counter whenever it (re)allocates the block, before anything (a kernel,
a load from the store) can write it. The daemon maps the array read-only and reads a published
block's counter before and after copying the block into another engine's arena (the HBM tier): an
unchanged counter proves the copy read the published bytes, so the engine never waits for, or
even knows of, such a copy. Counters only grow; a block's first allocation makes it 1.

Each counter is one aligned 8-byte word, written whole by a single writer (this engine's step
thread); on x86-64 the daemon's reads are ordered after its copy's reads (loads are not reordered
with older loads), so a counter read after the copy sees any bump that preceded a write the copy
could have seen.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import weakref
from multiprocessing import shared_memory

import numpy as np

from offload.vocab import GENERATION_BYTES, GENERATION_DTYPE


def _release(shm: shared_memory.SharedMemory, words: memoryview | None) -> None:
    if words is not None:
        with contextlib.suppress(BufferError):
            words.release()
    with contextlib.suppress(BufferError):
        shm.close()
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()


class BlockGenerations:
    """``num_blocks`` counters in a segment named ``name`` (unlinked on close, collection or exit).

    ``bump`` and ``get`` are for the engine's step thread only (one writer).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        name = f"kvgen_{os.getpid()}_{secrets.token_hex(6)}"
        self._shm = shared_memory.SharedMemory(name=name, create=True,
                                               size=num_blocks * GENERATION_BYTES)
        self.name = self._shm.name
        # A native 'Q' view is a fifth of NumPy's cost per item; the wire format is little-endian.
        self._words = self._shm.buf.cast("Q") if sys.byteorder == "little" else None
        self._array = np.ndarray((num_blocks,), dtype=GENERATION_DTYPE, buffer=self._shm.buf)
        self._array[:] = 0
        self._finalizer = weakref.finalize(self, _release, self._shm, self._words)

    def bump(self, block_id: int) -> None:
        """Block ``block_id`` is being reallocated: whatever was published of it is void."""
        if self._words is not None:
            self._words[block_id] += 1
        else:
            self._array[block_id] += 1

    def get(self, block_id: int) -> int:
        if self._words is not None:
            return self._words[block_id]
        return int(self._array[block_id])

    def close(self) -> None:
        """Unlink the segment (a daemon that mapped it keeps its mapping). Idempotent."""
        self._array = None
        self._finalizer()
        self._words = None
