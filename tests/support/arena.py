"""A test engine's KV arena: the memory an engine registers with the daemon, without an engine.

``ShmArena`` is block-major memory in anonymous shared memory (a memfd, registered by file
descriptor as a CPU engine's is); ``CudaArena`` is one cudaMalloc shared by CUDA IPC handle (a GPU
engine). Either may share block generations (the HBM-tier tests). The daemon's, the cluster's and
the reliability tests all use these; nothing here mocks the daemon: the arena is real memory the
daemon maps.
"""

from __future__ import annotations

import numpy as np

from kvstore.layout import KVLayout, Region
from offload.anon_memory import AnonymousMemory
from offload.block_generations import BlockGenerations

GUARD_FILL = (0xA5, 0x5A)  # the bytes of the guard before and the guard after the blocks


class ShmArena:
    """``num_blocks`` blocks of ``block_bytes`` in anonymous shared memory (``memory``; its
    layout's file descriptor 0), filled from ``seed`` (None: zeros).

    ``split_kv``: K pieces in the first half of the blocks' span, V pieces in the second (two
    regions). ``lead_bytes``: unregistered-but-mapped bytes before the blocks (offsets must be
    honoured). ``guard_bytes``: a guard pattern before and after the registered region; the one
    after lies outside it altogether, so a copy to or from a block outside the arena hits a
    guard. ``generations``: share block generations (``allocate`` bumps them).
    """

    def __init__(self, num_blocks: int, block_bytes: int, seed: int | None = None, *,
                 split_kv: bool = False, lead_bytes: int = 0, guard_bytes: int = 0,
                 generations: bool = False) -> None:
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self.start = guard_bytes + lead_bytes  # where the blocks begin
        self.guard_bytes = guard_bytes
        size = self.start + num_blocks * block_bytes + guard_bytes
        self.size_bytes = size
        self.memory = AnonymousMemory(size, "test-arena")
        self.array = np.ndarray((size,), np.uint8, self.memory.buf)
        if seed is None:
            self.array[:] = 0
        else:
            self.array[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        if guard_bytes:
            self.array[:guard_bytes] = GUARD_FILL[0]
            self.array[-guard_bytes:] = GUARD_FILL[1]
        self.generations = BlockGenerations(num_blocks) if generations else None
        end = self.start + num_blocks * block_bytes  # the registered memory ends here
        if split_kv:
            half = block_bytes // 2
            regions = (Region(0, end, self.start, half, half),
                       Region(0, end, self.start + num_blocks * half, half, half))
        else:
            regions = (Region(0, end, self.start, block_bytes, block_bytes),)
        self.layout = KVLayout(num_blocks, regions, device="cpu", dtype="uint8",
                               fds=(self.memory.fd,))
        if self.generations is not None:
            self.layout = self.layout.with_generations(self.generations.fd)

    @property
    def blocks(self) -> np.ndarray:
        """The blocks as ``[num_blocks, block_bytes]`` (one region only: not ``split_kv``)."""
        assert len(self.layout.regions) == 1, "a split arena's blocks are not contiguous"
        end = self.start + self.num_blocks * self.block_bytes
        return self.array[self.start:end].reshape(self.num_blocks, self.block_bytes)

    def block_offset(self, block_id: int) -> int:
        """Where block ``block_id`` starts in ``array`` (one region only)."""
        return self.start + block_id * self.block_bytes

    def block(self, block_id: int) -> bytes:
        """Block ``block_id`` as the daemon sees it: its region pieces, concatenated."""
        out = bytearray()
        for r in self.layout.regions:
            start, end = r.piece_bounds(block_id)
            out += self.array[start:end].tobytes()
        return bytes(out)

    def allocate(self, block_ids: list[int]) -> list[int]:
        """What the engine's block manager does on allocation; returns the new generations."""
        for b in block_ids:
            self.generations.bump(b)
        return [self.generations.get(b) for b in block_ids]

    def snapshot(self) -> bytes:
        """Every byte of the segment, guards included."""
        return self.array.tobytes()

    def guards_intact(self) -> bool:
        g = self.guard_bytes
        assert g, "an arena without guards"
        return bool((self.array[:g] == GUARD_FILL[0]).all()
                    and (self.array[-g:] == GUARD_FILL[1]).all())

    def close(self) -> None:
        del self.array
        self.memory.close()
        if self.generations is not None:
            self.generations.close()

    def __enter__(self) -> ShmArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CudaArena:
    """``kv[num_blocks, block_bytes]`` in its own cudaMalloc (an IPC handle names a whole
    allocation, so not from CuPy's pool), filled from ``seed`` (None: zeros), with block
    generations unless ``generations=False``. Needs CuPy and a GPU: the ``gpu`` tests only."""

    def __init__(self, num_blocks: int, block_bytes: int, seed: int | None,
                 dtype: str = "bfloat16", *, generations: bool = True,
                 meta: dict | None = None) -> None:
        import cupy as cp

        self.num_blocks = num_blocks
        self.memory = cp.cuda.Memory(num_blocks * block_bytes)
        self.kv = cp.ndarray((num_blocks, block_bytes), cp.uint8,
                             cp.cuda.MemoryPointer(self.memory, 0))
        self.fill(seed)
        self.generations = BlockGenerations(num_blocks) if generations else None
        handle = bytes(cp.cuda.runtime.ipcGetMemHandle(self.memory.ptr))
        region = Region(handle, num_blocks * block_bytes, 0, block_bytes, block_bytes)
        self.layout = KVLayout(num_blocks, (region,), device="cuda:0", dtype=dtype,
                               **({"meta": meta} if meta is not None else {}))
        if self.generations is not None:
            self.layout = self.layout.with_generations(self.generations.fd)

    def fill(self, seed: int | None) -> None:
        """Every byte from ``seed`` (None: zeros)."""
        import cupy as cp

        if seed is None:
            self.kv[...] = 0
        else:
            self.kv[...] = cp.random.RandomState(seed).randint(0, 256, self.kv.shape,
                                                               dtype=cp.uint8)
        cp.cuda.Device().synchronize()

    def allocate(self, block_ids: list[int]) -> list[int]:
        """What the engine's block manager does on allocation; returns the new generations."""
        for b in block_ids:
            self.generations.bump(b)
        return [self.generations.get(b) for b in block_ids]

    def blocks(self, block_ids: list[int]) -> np.ndarray:
        return self.kv[block_ids].get()
