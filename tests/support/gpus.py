"""How many CUDA devices the GPU tests may use (0 without CuPy or a driver)."""

from __future__ import annotations


def num_cuda_devices() -> int:
    try:
        import cupy as cp

        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, or no driver: CuPy raises instead of counting 0
        return 0
