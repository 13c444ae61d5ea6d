"""The engine's one KV arena, block-major, and its description for the store.

``kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``: block ``b`` is one contiguous
run of ``block_bytes`` bytes at ``b * block_bytes``, so one ``kvstore.layout.Region`` describes the
whole arena. On CPU it lives in anonymous shared memory (a memfd, nothing in /dev/shm), which the
daemon maps from the file descriptor the registration sends.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np

from kernels.ops import Array
from offload.anon_memory import AnonymousMemory
from offload.vocab import KVLayout, Region

KV_LAYOUT_NAME = "block-major"


def kv_block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int
) -> int:
    """Bytes of one block: K and V of ``block_size`` tokens for every layer."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize


class KVCache(ABC):
    """The arena: ``array`` is the device array the kernels read and write."""

    array: Array
    shape: tuple[int, ...]
    dtype: str

    @property
    def num_blocks(self) -> int:
        return self.shape[0]

    @property
    def block_bytes(self) -> int:
        return math.prod(self.shape[1:]) * np.dtype(self.dtype).itemsize

    @abstractmethod
    def layout(self) -> KVLayout:
        """One region covering the arena, as the daemon's ``register`` verb takes it."""

    @abstractmethod
    def close(self) -> None:
        """Release the memory; the arena must not be used afterwards. Idempotent."""

    def _layout_meta(self) -> dict:
        _, num_layers, _, block_size, num_kv_heads, head_dim = self.shape
        return {"layout": KV_LAYOUT_NAME, "shape": list(self.shape), "num_layers": num_layers,
                "block_size": block_size, "num_kv_heads": num_kv_heads, "head_dim": head_dim}


class SharedMemoryKVCache(KVCache):
    """The CPU arena in anonymous shared memory (``memory``: a sealed memfd), released on close
    (or when the object is collected)."""

    def __init__(self, shape: tuple[int, ...], dtype: str = "float32") -> None:
        if len(shape) != 6 or min(shape) <= 0:
            raise ValueError(f"KV arena shape must be 6 positive dims, got {shape}")
        self.shape = tuple(int(n) for n in shape)
        self.dtype = dtype
        nbytes = math.prod(self.shape) * np.dtype(dtype).itemsize
        self.memory = AnonymousMemory(nbytes, "kvengine-arena")
        self.size_bytes = nbytes
        self.array = np.ndarray(self.shape, dtype=dtype, buffer=self.memory.buf)

    def layout(self) -> KVLayout:
        """One region in the memory of file descriptor 0 of the registration (``fds``)."""
        region = Region(handle=0, size_bytes=self.size_bytes, offset=0,
                        block_stride=self.block_bytes, block_bytes=self.block_bytes)
        layout = KVLayout(num_blocks=self.num_blocks, regions=(region,), device="cpu",
                          dtype=self.dtype, meta=self._layout_meta(), fds=(self.memory.fd,))
        layout.validate()
        return layout

    def close(self) -> None:
        self.array = None
        self.memory.close()
