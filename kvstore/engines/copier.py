"""Batched block copies between a registered engine's GPU KV memory and the pinned host pool.

The daemon opens each engine's CUDA IPC handle once per registration (``CudaIpcMapping``) and moves
blocks with ``CudaCopier``: one non-blocking stream per direction, copies coalesced into the fewest
``cudaMemcpyAsync`` runs (a block of the block-major arena is one contiguous run, so a batch of
blocks is at most one call per block and fewer when block ids are consecutive), and a CUDA event
recorded after the batch. Completion is the event, never a sleep loop. Device-to-device copies
(the HBM tier: one engine's arena into another's) run on a third stream of their own.

A mapping's size is the driver's, not the engine's word: ``CudaIpcMapping`` asks
``cuMemGetAddressRange`` how large the opened allocation really is, and the registry refuses a
layout that claims more.

One 2.36 MB block per call reaches about 93% of one big memcpy on an H100 (the copy engine idles a
few microseconds between calls); dealing the calls over two streams of the same direction did not
close that gap (measured: 47-51 GB/s either way against 55 raw), so there is one stream.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_MEMCPY_HOST_TO_DEVICE = 1
_MEMCPY_DEVICE_TO_HOST = 2
_MEMCPY_DEFAULT = 4  # direction from the (unified) addresses: device to device, peers included
_IPC_LAZY_ENABLE_PEER_ACCESS = 1
_GATHER_MIN_RUNS = 8  # device-to-device batches with this many runs go through one kernel
# Host <-> device batches of many small runs (vLLM's layout: one 32 KiB piece per layer and K/V)
# go through the same kernel over the pinned pool's mapped addresses: one cudaMemcpyAsync per
# 32 KiB run reaches ~6 GB/s, a kernel reading mapped pinned memory ~46 GB/s (H100). Large runs
# (kvengine's block-major arena: one 2+ MB run per block) stay on the copy engines.
_GATHER_MAX_MEAN_RUN_BYTES = 512 << 10
_CUDA_MEMORY_TYPE_HOST = 1


@dataclass(frozen=True)
class CopyRun:
    """``num_bytes`` from ``src_ptr`` to ``dst_ptr`` (plain integers: device or host addresses)."""

    src_ptr: int
    dst_ptr: int
    num_bytes: int


def coalesce(runs: Iterable[CopyRun]) -> list[CopyRun]:
    """Merge runs that continue each other on both sides, keeping the given order."""
    out: list[CopyRun] = []
    for run in runs:
        if run.num_bytes <= 0:
            continue
        if out:
            last = out[-1]
            if (last.src_ptr + last.num_bytes == run.src_ptr
                    and last.dst_ptr + last.num_bytes == run.dst_ptr):
                out[-1] = CopyRun(last.src_ptr, last.dst_ptr, last.num_bytes + run.num_bytes)
                continue
        out.append(run)
    return out


def _cupy():
    import cupy  # imported lazily: the CPU daemon never needs it

    return cupy


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one device."""
    try:
        return _cupy().cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    """The CUDA driver library (CuPy links it, so it is loaded already wherever CUDA runs)."""
    name = "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        found = ctypes.util.find_library("cuda")
        if found is None:
            raise
        lib = ctypes.CDLL(found)
    fn = lib.cuMemGetAddressRange_v2  # what cuda.h's cuMemGetAddressRange names since CUDA 3.2
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                   ctypes.c_uint64]
    fn.restype = ctypes.c_int
    return lib


def allocation_range(ptr: int) -> tuple[int, int]:
    """(base address, size in bytes) of the device allocation that holds ``ptr``.

    Call with the pointer's device current (a CUDA context must be). RuntimeError with the
    driver's error code if the driver does not know the address.
    """
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    result = _libcuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                ctypes.c_uint64(int(ptr)))
    if result != 0:
        raise RuntimeError(f"cuMemGetAddressRange(0x{int(ptr):x}) failed with CUresult {result}")
    return int(base.value), int(size.value)


@functools.lru_cache(maxsize=256)
def can_access_peer(device_id: int, peer_device_id: int) -> bool:
    """True when ``device_id`` can read ``peer_device_id``'s memory directly (same device too)."""
    if device_id == peer_device_id:
        return True
    try:
        return bool(_cupy().cuda.runtime.deviceCanAccessPeer(device_id, peer_device_id))
    except Exception:
        return False


class CudaIpcMapping:
    """An engine's device buffer opened from its IPC handle; valid until ``close()``.

    ``mapped_bytes`` is how many bytes from ``ptr`` the opened allocation really has (the
    driver's answer), whatever size the engine claimed.
    """

    def __init__(self, handle: bytes, size_bytes: int, device_id: int) -> None:
        cp = _cupy()
        self.device_id = device_id
        self.size_bytes = size_bytes
        with cp.cuda.Device(device_id):
            self.ptr = int(cp.cuda.runtime.ipcOpenMemHandle(bytes(handle),
                                                            _IPC_LAZY_ENABLE_PEER_ACCESS))
            try:
                base, num_bytes = allocation_range(self.ptr)
            except BaseException:
                cp.cuda.runtime.ipcCloseMemHandle(self.ptr)
                raise
        self.mapped_bytes = max(0, base + num_bytes - self.ptr)
        self._open = True

    def close(self) -> None:
        if self._open:
            cp = _cupy()
            with cp.cuda.Device(self.device_id):
                cp.cuda.runtime.ipcCloseMemHandle(self.ptr)
            self._open = False


class CopyHandle:
    """One submitted batch: ``poll()`` never blocks, ``wait()`` blocks on the event.

    Both raise the CUDA error a copy of the batch hit.
    """

    def __init__(self, event, num_bytes: int) -> None:
        self._event = event
        self.num_bytes = num_bytes

    def poll(self) -> bool:
        return bool(self._event.done)

    def wait(self) -> None:
        self._event.synchronize()


class CudaCopier:
    """Per-device copy streams (one per direction, one for device to device); ``submit``
    enqueues coalesced runs and returns an event handle."""

    def __init__(self, device_id: int) -> None:
        cp = _cupy()
        self.device_id = device_id
        with cp.cuda.Device(device_id):
            self._streams = {
                _MEMCPY_DEVICE_TO_HOST: cp.cuda.Stream(non_blocking=True),
                _MEMCPY_HOST_TO_DEVICE: cp.cuda.Stream(non_blocking=True),
                _MEMCPY_DEFAULT: cp.cuda.Stream(non_blocking=True),
            }

    def _submit(self, runs: Sequence[CopyRun], kind: int, gather: bool = False) -> CopyHandle:
        """Enqueue the coalesced runs on the ``kind`` stream, as ``cudaMemcpyAsync`` calls or
        (``gather``) one ``copy_runs_varlen`` launch; an event after them is the handle."""
        cp = _cupy()
        merged = coalesce(runs)
        stream = self._streams[kind]
        with cp.cuda.Device(self.device_id):
            try:
                if gather:
                    from kernels.block_copy import copy_runs_varlen

                    longest = max(r.num_bytes for r in merged)  # CTAs per run: ~256 KiB each
                    copy_runs_varlen([r.src_ptr for r in merged], [r.dst_ptr for r in merged],
                                     [r.num_bytes for r in merged], stream=stream,
                                     blocks_per_run=min(128, max(4, longest >> 18)))
                else:
                    for run in merged:
                        cp.cuda.runtime.memcpyAsync(int(run.dst_ptr), int(run.src_ptr),
                                                    int(run.num_bytes), kind, stream.ptr)
            except BaseException:
                # The runs enqueued before the failing one have no event: wait for them here, so
                # no copy is still touching the caller's buffers once it hears of the error.
                with contextlib.suppress(Exception):
                    stream.synchronize()
                raise
            event = cp.cuda.Event(block=True, disable_timing=True)
            event.record(stream)
        return CopyHandle(event, sum(r.num_bytes for r in merged))

    def device_to_host(self, runs: Sequence[CopyRun]) -> CopyHandle:
        """Save direction: engine HBM → pinned pool."""
        merged = coalesce(runs)
        return self._submit(merged, _MEMCPY_DEVICE_TO_HOST,
                            gather=self._gather_pays(merged, [r.dst_ptr for r in merged]))

    def host_to_device(self, runs: Sequence[CopyRun]) -> CopyHandle:
        """Load direction: pinned pool → engine HBM."""
        merged = coalesce(runs)
        return self._submit(merged, _MEMCPY_HOST_TO_DEVICE,
                            gather=self._gather_pays(merged, [r.src_ptr for r in merged]))

    def _gather_pays(self, merged: Sequence[CopyRun], host_ptrs: Sequence[int]) -> bool:
        """Many small aligned runs whose host side the device can address at the same pointer
        (page-locked, mapped, unified addressing): one gather launch beats a memcpy per run.
        Unpinned host memory always goes through ``cudaMemcpyAsync``."""
        if len(merged) < _GATHER_MIN_RUNS or \
                sum(r.num_bytes for r in merged) > _GATHER_MAX_MEAN_RUN_BYTES * len(merged):
            return False
        if any(r.num_bytes % 16 or r.src_ptr % 16 or r.dst_ptr % 16 for r in merged):
            return False
        return all(self._device_addressable(p) for p in {host_ptrs[0], host_ptrs[-1]})

    def _device_addressable(self, host_ptr: int) -> bool:
        cp = _cupy()
        try:
            with cp.cuda.Device(self.device_id):
                attrs = cp.cuda.runtime.pointerGetAttributes(host_ptr)
        except Exception:  # not known to CUDA: plain pageable memory
            return False
        return attrs.type == _CUDA_MEMORY_TYPE_HOST and attrs.devicePointer == host_ptr

    def device_to_device(self, runs: Sequence[CopyRun]) -> CopyHandle:
        """HBM tier: one engine's arena → another's, on this (the destination's) device.

        Few runs go as ``cudaMemcpyAsync`` calls; many (shuffled block ids) as one launch of the
        ``copy_runs_varlen`` gather kernel, since each call costs ~5 us, more than copying a
        2 MB block at HBM speed."""
        merged = coalesce(runs)
        aligned = all(r.num_bytes % 16 == 0 and r.src_ptr % 16 == 0 and r.dst_ptr % 16 == 0
                      for r in merged)
        return self._submit(merged, _MEMCPY_DEFAULT,
                            gather=len(merged) >= _GATHER_MIN_RUNS and aligned)
