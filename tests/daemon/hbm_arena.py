"""A test engine's KV arena for the HBM-tier tests: shared memory plus its block generations."""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np

from kvstore.layout import KVLayout, Region
from offload.block_generations import BlockGenerations

NUM_BLOCKS = 16
BLOCK_BYTES = 32 * 1024


class Arena:
    """An engine's block-major arena in shared memory plus its block generations."""

    def __init__(self, seed: int | None, num_blocks: int = NUM_BLOCKS,
                 split_kv: bool = False) -> None:
        size = num_blocks * BLOCK_BYTES
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        self.array = np.ndarray((size,), np.uint8, self.shm.buf)
        if seed is None:
            self.array[:] = 0
        else:
            self.array[:] = np.random.default_rng(seed).integers(0, 256, size)
        self.generations = BlockGenerations(num_blocks)
        if split_kv:  # K pieces in the first half of the segment, V pieces in the second
            half = BLOCK_BYTES // 2
            regions = (Region(self.shm.name, size, 0, half, half),
                       Region(self.shm.name, size, num_blocks * half, half, half))
        else:
            regions = (Region(self.shm.name, size, 0, BLOCK_BYTES, BLOCK_BYTES),)
        self.layout = KVLayout(num_blocks, regions, device="cpu", dtype="uint8",
                               generations=self.generations.name)

    def allocate(self, block_ids: list[int]) -> list[int]:
        """What the engine's block manager does on allocation; returns the new generations."""
        for b in block_ids:
            self.generations.bump(b)
        return [self.generations.get(b) for b in block_ids]

    def block(self, block_id: int) -> bytes:
        out = bytearray()
        for r in self.layout.regions:
            start, end = r.piece_bounds(block_id)
            out += self.array[start:end].tobytes()
        return bytes(out)

    def close(self) -> None:
        del self.array
        self.shm.close()
        self.shm.unlink()
        self.generations.close()
