"""Batched block copies between a registered engine's GPU KV memory and the pinned host pool.

The daemon opens each engine's CUDA IPC handle once per registration (``CudaIpcMapping``) and moves
blocks with ``CudaCopier``: one non-blocking stream per direction, copies coalesced into the fewest
``cudaMemcpyAsync`` runs (a block of the block-major arena is one contiguous run, so a batch of
blocks is at most one call per block and fewer when block ids are consecutive), and a CUDA event
recorded after the batch. Completion is the event, never a sleep loop.

One 2.36 MB block per call reaches about 93% of one big memcpy on an H100 (the copy engine idles a
few microseconds between calls); dealing the calls over two streams of the same direction did not
close that gap (measured: 47-51 GB/s either way against 55 raw), so there is one stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_MEMCPY_HOST_TO_DEVICE = 1
_MEMCPY_DEVICE_TO_HOST = 2
_IPC_LAZY_ENABLE_PEER_ACCESS = 1


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


class CudaIpcMapping:
    """An engine's device buffer opened from its IPC handle; valid until ``close()``."""

    def __init__(self, handle: bytes, size_bytes: int, device_id: int) -> None:
        cp = _cupy()
        self.device_id = device_id
        self.size_bytes = size_bytes
        with cp.cuda.Device(device_id):
            self.ptr = int(cp.cuda.runtime.ipcOpenMemHandle(bytes(handle),
                                                            _IPC_LAZY_ENABLE_PEER_ACCESS))
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
    """Per-device copy streams; ``submit`` enqueues coalesced runs and returns an event handle."""

    def __init__(self, device_id: int) -> None:
        cp = _cupy()
        self.device_id = device_id
        with cp.cuda.Device(device_id):
            self._streams = {
                _MEMCPY_DEVICE_TO_HOST: cp.cuda.Stream(non_blocking=True),
                _MEMCPY_HOST_TO_DEVICE: cp.cuda.Stream(non_blocking=True),
            }

    def _submit(self, runs: Sequence[CopyRun], kind: int) -> CopyHandle:
        cp = _cupy()
        merged = coalesce(runs)
        stream = self._streams[kind]
        with cp.cuda.Device(self.device_id):
            try:
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
        return self._submit(runs, _MEMCPY_DEVICE_TO_HOST)

    def host_to_device(self, runs: Sequence[CopyRun]) -> CopyHandle:
        """Load direction: pinned pool → engine HBM."""
        return self._submit(runs, _MEMCPY_HOST_TO_DEVICE)
