"""``cuMemcpyBatchAsync``: many copies in one driver call (CUDA 12.8+ drivers), through ctypes.

The CUDA 13 form (``cuMemcpyBatchAsync_v2``: no ``failIdx``) is asked of the driver
(``cuda_driver``), so a CUDA 12.x library beside a newer driver cannot call it with the wrong
argument list; a driver without it makes ``available()`` False. One attribute
entry applies to every copy: source read in stream order unless the caller names another order
(``benchmarks.batch_order`` compares them), location hints from the direction.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvstore.engines.cuda_driver import driver_function
from kvstore.engines.run_arrays import RunArrays

# CUmemcpySrcAccessOrder: STREAM (read in stream order) or ANY (the driver may read the source
# out of stream order, even after the call returns; no earlier work on the stream may touch it)
SRC_ACCESS_ORDER_STREAM = 1
SRC_ACCESS_ORDER_ANY = 3
# CUmemcpyFlags: CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
_LOCATION_DEVICE = 1
_LOCATION_HOST = 2


class MemLocation(ctypes.Structure):
    """cuda.h's ``CUmemLocation``: {CUmemLocationType type; int id} (8 bytes)."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """cuda.h's ``CUmemcpyAttributes_v1``: srcAccessOrder, srcLocHint, dstLocHint, flags
    (24 bytes; the CPU tests pin the offsets)."""

    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_hint", MemLocation),
                ("dst_loc_hint", MemLocation), ("flags", ctypes.c_uint)]


# CUDA 13: (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, hStream); 12.8's form had a
# size_t* failIdx before hStream.
_ARGS = (ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
         ctypes.POINTER(MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
         ctypes.c_void_p)
MEMCPY_BATCH_ASYNC = ctypes.CFUNCTYPE(*_ARGS)  # lets go of the GIL for the call
# Keeps the GIL (``CopySettings.batch_keeps_gil``): a thread that lets go of it waits to get it
# back behind any other runnable thread, once per chunk of a save or load; but a call that
# blocks then stops every thread.
MEMCPY_BATCH_ASYNC_HOLDING_GIL = ctypes.PYFUNCTYPE(*_ARGS)


def _batch_fn(keep_gil: bool = False):
    """The driver's cuMemcpyBatchAsync of the CUDA 13 signature, or None."""
    return driver_function(b"cuMemcpyBatchAsync", MEMCPY_BATCH_ASYNC_HOLDING_GIL if keep_gil
                           else MEMCPY_BATCH_ASYNC)


def available() -> bool:
    """True when the driver has the CUDA 13 ``cuMemcpyBatchAsync``."""
    return _batch_fn() is not None


def memcpy_batch(runs: RunArrays, stream_ptr: int, src_on_device: bool, dst_on_device: bool,
                 device_id: int, src_order: int = SRC_ACCESS_ORDER_STREAM,
                 flags: int = 0, *, keep_gil: bool) -> None:
    """Enqueue every run on ``stream_ptr`` (not the legacy NULL stream) in one driver call;
    RuntimeError with the CUresult if the driver refuses the batch (nothing was enqueued).
    ``src_order`` / ``flags``: the batch's one attribute entry (``benchmarks.batch_order``
    compares them); ``keep_gil``: call it holding the GIL (``CopySettings.batch_keeps_gil``)."""
    fn = _batch_fn(keep_gil)
    if fn is None:
        raise RuntimeError("this CUDA driver has no cuMemcpyBatchAsync")
    if not len(runs):
        return
    dsts = np.ascontiguousarray(runs.dst_ptrs, dtype=np.int64)
    srcs = np.ascontiguousarray(runs.src_ptrs, dtype=np.int64)
    sizes = np.ascontiguousarray(runs.num_bytes, dtype=np.int64)

    def hint(on_device: bool) -> MemLocation:
        return MemLocation(_LOCATION_DEVICE, device_id) if on_device else \
            MemLocation(_LOCATION_HOST, 0)

    attrs = MemcpyAttributes(src_order, hint(src_on_device), hint(dst_on_device), flags)
    first = ctypes.c_size_t(0)
    result = fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes),
                ctypes.byref(attrs), ctypes.byref(first), 1, ctypes.c_void_p(stream_ptr))
    if result != 0:
        raise RuntimeError(f"cuMemcpyBatchAsync of {len(sizes)} copies failed with CUresult "
                           f"{result}")
