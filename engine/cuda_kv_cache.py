"""The GPU KV arena: one cudaMalloc'd block-major buffer, shared with the store by CUDA IPC.

The arena is allocated directly (``cupy.cuda.Memory``), not from CuPy's memory pool, so its pointer
is the base of its own allocation: a CUDA IPC handle names exactly the arena and offset 0 of the
mapping the daemon opens is block 0. The buffer is zeroed once, so no block ever holds NaN bits.
"""

from __future__ import annotations

import math

import cupy as cp
import numpy as np

from engine.kv_cache import KVCache
from kernels.cuda_module import BF16
from offload.vocab import KVLayout, Region

_DTYPES = {"bfloat16": BF16, "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}


class CudaKVCache(KVCache):
    """``kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` on the current CUDA
    device. ``close`` drops the buffer: the memory goes back when the last view of it is gone."""

    def __init__(self, shape: tuple[int, ...], dtype: str = "bfloat16") -> None:
        if len(shape) != 6 or min(shape) <= 0:
            raise ValueError(f"KV arena shape must be 6 positive dims, got {shape}")
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported KV dtype {dtype!r}; expected one of {list(_DTYPES)}")
        self.shape = tuple(int(n) for n in shape)
        self.dtype = dtype
        self.device_id = cp.cuda.Device().id
        self.size_bytes = math.prod(self.shape) * _DTYPES[dtype].itemsize
        free_bytes, _ = cp.cuda.runtime.memGetInfo()
        if self.size_bytes > free_bytes:
            raise MemoryError(f"the KV arena needs {self.size_bytes} bytes, the GPU has "
                              f"{free_bytes} free; lower num_kv_blocks or gpu_memory_utilization")
        self._memory = cp.cuda.Memory(self.size_bytes)
        cp.cuda.runtime.memset(self._memory.ptr, 0, self.size_bytes)
        self.ptr = self._memory.ptr
        self.array = cp.ndarray(self.shape, dtype=_DTYPES[dtype],
                                memptr=cp.cuda.MemoryPointer(self._memory, 0))

    def ipc_handle(self) -> bytes:
        """The CUDA IPC handle of the arena's allocation (its base is ``ptr``)."""
        return bytes(cp.cuda.runtime.ipcGetMemHandle(self.ptr))

    def layout(self) -> KVLayout:
        region = Region(handle=self.ipc_handle(), size_bytes=self.size_bytes, offset=0,
                        block_stride=self.block_bytes, block_bytes=self.block_bytes)
        layout = KVLayout(num_blocks=self.num_blocks, regions=(region,),
                          device=f"cuda:{self.device_id}", dtype=self.dtype,
                          meta=self._layout_meta())
        layout.validate()
        return layout

    def close(self) -> None:
        if self.array is not None:
            cp.cuda.Device(self.device_id).synchronize()  # no kernel still writes the arena
        self.array = None
        self._memory = None
