"""Choosing the KV arena for a resolved device: shared memory on CPU, a CUDA IPC-shareable
allocation on a GPU (the GPU arena imports CuPy, so only the GPU path loads it)."""

from __future__ import annotations

from engine.kv_cache import KVCache, SharedMemoryKVCache


def make_kv_cache(device: str, shape: tuple[int, ...], dtype: str) -> KVCache:
    """The arena for a resolved device."""
    if device == "cpu":
        return SharedMemoryKVCache(shape, dtype)
    if device == "cuda":
        from engine.cuda_kv_cache import CudaKVCache  # imports CuPy: only on the GPU path

        return CudaKVCache(shape, dtype)
    raise ValueError(f"unknown device {device!r}; expected 'cpu' or 'cuda'")
