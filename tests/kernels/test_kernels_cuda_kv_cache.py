"""The CUDA KV arena: its own allocation, zeroed, described as one region with a CUDA IPC handle
that another process can open and read the same bytes through."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SHAPE = (6, 3, 2, 16, 2, 64)  # blocks, layers, K/V, block_size, Hkv, D


def test_arena_is_a_zeroed_allocation_of_its_own() -> None:
    import cupy as cp

    from engine.kv_arena import make_kv_cache

    cache = make_kv_cache("cuda", SHAPE, "bfloat16")
    try:
        assert cache.array.shape == SHAPE and cache.array.dtype.name == "bfloat16"
        assert cache.array.data.ptr == cache.ptr
        assert int(cp.count_nonzero(cache.array.view(cp.uint16))) == 0
        layout = cache.layout()
        (region,) = layout.regions
        assert layout.device == f"cuda:{cp.cuda.Device().id}" and layout.dtype == "bfloat16"
        assert layout.num_blocks == 6 and region.offset == 0
        assert region.block_bytes == region.block_stride == 3 * 2 * 16 * 2 * 64 * 2
        assert region.size_bytes == 6 * region.block_bytes
        assert isinstance(region.handle, bytes) and len(region.handle) == 64
        assert layout.meta["layout"] == "block-major"
    finally:
        cache.close()
        cache.close()  # idempotent
    assert cache.array is None


def test_ipc_handle_maps_the_arena_in_another_process() -> None:
    import cupy as cp

    from engine.cuda_kv_cache import CudaKVCache

    cache = CudaKVCache(SHAPE)
    try:
        bits = cp.arange(cache.array.size, dtype=cp.uint16).reshape(SHAPE)
        cache.array.view(cp.uint16)[...] = bits
        cp.cuda.Device().synchronize()
        region = cache.layout().regions[0]
        block = 4
        start, end = region.piece_bounds(block)
        child = textwrap.dedent(f"""
            import cupy as cp, numpy as np, sys
            ptr = cp.cuda.runtime.ipcOpenMemHandle(bytes.fromhex("{region.handle.hex()}"))
            host = np.empty({end - start}, dtype=np.uint8)
            cp.cuda.runtime.memcpy(host.ctypes.data, ptr + {start}, host.nbytes, 2)
            sys.stdout.write(host.tobytes().hex())
            cp.cuda.runtime.ipcCloseMemHandle(ptr)
        """)
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        want = cp.asnumpy(bits[block]).tobytes()
        assert bytes.fromhex(out.stdout) == want
    finally:
        cache.close()


def test_arena_rejects_bad_shapes() -> None:
    from engine.cuda_kv_cache import CudaKVCache

    with pytest.raises(ValueError):
        CudaKVCache((4, 2, 2, 16, 2))
    with pytest.raises(ValueError):
        CudaKVCache((0, 2, 2, 16, 2, 64))
    with pytest.raises(MemoryError):
        CudaKVCache((1 << 40, 1, 2, 16, 8, 128))
    assert np.dtype("bfloat16").itemsize == 2  # ml_dtypes registered the name
