"""bf16 GEMMs through cuBLAS called directly (ctypes), so they can be captured into CUDA graphs.

CuPy's own cuBLAS wrappers refuse to run while a stream captures. cuBLAS itself captures fine as
long as it never allocates during the capture, so this module owns one handle with a fixed
workspace (set again after every ``cublasSetStream``, which resets it) and issues
``cublasGemmEx`` itself: bf16 in and out, float32 accumulation, the library's default algorithm
choice. The eager path uses the same calls, so a replayed graph computes the same bits.
"""

from __future__ import annotations

import ctypes
from functools import cache

import cupy as cp

from kernels.cuda_module import BF16, check

_OP_N, _OP_T = 0, 1
_CUDA_R_16BF = 14
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1
_WORKSPACE_BYTES = 32 * 1024 * 1024  # what cuBLAS asks for on Hopper


@cache
def _library() -> ctypes.CDLL:
    """The libcublas CuPy already loaded (found in this process's mappings), else by name."""
    import cupy_backends.cuda.libs.cublas  # noqa: F401  (loads libcublas)

    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/libcublas.so" in path:
                return ctypes.CDLL(path)
    for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("libcublas is not loadable")


def _ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


class CublasGemm:
    """``out[T, N] = x[T, K] @ weight[N, K].T`` for C-contiguous bf16 arrays, on the current
    stream; one per device."""

    def __init__(self) -> None:
        lib = _library()
        self._lib = lib
        handle = ctypes.c_void_p()
        _ok(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self._handle = handle
        self._workspace = cp.empty(_WORKSPACE_BYTES, dtype=cp.uint8)  # held for our whole life
        self._alpha = ctypes.c_float(1.0)
        self._beta = ctypes.c_float(0.0)
        lib.cublasGemmEx.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.cublasSetStream_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cublasSetWorkspace_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]

    def __call__(self, x: cp.ndarray, weight: cp.ndarray) -> cp.ndarray:
        check(x, "x", BF16, 2)
        check(weight, "weight", BF16, 2)
        rows, inner = x.shape
        cols = weight.shape[0]
        if weight.shape[1] != inner:
            raise ValueError(f"x {x.shape} and weight {weight.shape} disagree on the inner size")
        out = cp.empty((rows, cols), dtype=BF16)
        if rows == 0 or cols == 0:
            return out
        lib, handle = self._lib, self._handle
        _ok(lib.cublasSetStream_v2(handle, cp.cuda.get_current_stream().ptr), "cublasSetStream")
        _ok(lib.cublasSetWorkspace_v2(handle, self._workspace.data.ptr, _WORKSPACE_BYTES),
            "cublasSetWorkspace")
        # column-major view: out^T[N, T] = weight[N, K] (stored as K x N, transposed) @ x^T
        _ok(lib.cublasGemmEx(
            handle, _OP_T, _OP_N, cols, rows, inner, ctypes.byref(self._alpha),
            weight.data.ptr, _CUDA_R_16BF, inner, x.data.ptr, _CUDA_R_16BF, inner,
            ctypes.byref(self._beta), out.data.ptr, _CUDA_R_16BF, cols, _COMPUTE_32F,
            _GEMM_DEFAULT), "cublasGemmEx")
        return out
