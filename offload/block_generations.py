"""An engine's block generations: one uint64 counter per block id, in anonymous shared memory.

The engine bumps a block's counter whenever it (re)allocates the block, before anything (a kernel,
a load from the store) can write it. The daemon maps the array read-only and reads a published
block's counter before and after copying the block into another engine's arena (the HBM tier): an
unchanged counter proves the copy read the published bytes, so the engine never waits for, or
even knows of, such a copy. Counters only grow; a block's first allocation makes it 1. The memory
is a memfd the daemon receives by file descriptor with the registration (``fd``;
``KVLayout.with_generations``).

Each counter is one aligned 8-byte word, written whole by a single writer (this engine's step
thread); on x86-64 the daemon's reads are ordered after its copy's reads (loads are not reordered
with older loads), so a counter read after the copy sees any bump that preceded a write the copy
could have seen.
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import numpy as np

from offload.anon_memory import AnonymousMemory
from offload.vocab import GENERATION_BYTES, GENERATION_DTYPE


def _release(memory: AnonymousMemory, words: memoryview | None) -> None:
    if words is not None:
        with contextlib.suppress(BufferError):
            words.release()
    memory.close()


class BlockGenerations:
    """``num_blocks`` counters in anonymous shared memory (released on close or collection).

    ``bump`` and ``get`` are for the engine's step thread only (one writer).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self._memory = AnonymousMemory(num_blocks * GENERATION_BYTES, "kvengine-generations")
        # A native 'Q' view is a fifth of NumPy's cost per item; the wire format is little-endian.
        self._words = self._memory.buf.cast("Q") if sys.byteorder == "little" else None
        self._array = np.ndarray((num_blocks,), dtype=GENERATION_DTYPE, buffer=self._memory.buf)
        self._array[:] = 0
        self._finalizer = weakref.finalize(self, _release, self._memory, self._words)

    @property
    def fd(self) -> int:
        """The counters' file descriptor, for the registration (``KVLayout.with_generations``)."""
        return self._memory.fd

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
        """Release the memory (a daemon that mapped it keeps its mapping). Idempotent."""
        self._array = None
        self._finalizer()
        self._words = None
