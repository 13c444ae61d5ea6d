"""PinnedUpload: checkpoint tensors to the GPU through two pinned staging buffers, in the
background.

``cp.asarray`` of a host array copies synchronously from pageable memory (the driver stages it
through a small pinned buffer of its own), one tensor after another: about 2.6 GB/s for a
Qwen3-4B checkpoint read from the page cache, most of a warm start. Here host threads copy the
tensor's bytes (from the checkpoint's memory map) into one pinned buffer while the device
copies the other one's bytes out (``cudaMemcpyAsync`` on a stream of the upload's own), so the
page cache, the host copy and the bus work at once.

The upload is planned first and run after: ``upload`` and ``upload_stacked`` allocate each
device array at once (its address is final) and queue its bytes; ``start`` moves every queued
byte on a thread of its own, so the engine's start-time warm-up (graph captures record
addresses, not values) runs beside it instead of after it; ``finish`` waits for the last byte
and raises what the upload met. Until ``finish`` returns an array's contents are undefined:
only work whose result is thrown away (a warm-up) may read them.

Not a kernel: a transfer, beside ``Ops.weight_from_host`` which uses it. No NumPy reference is
needed: the bytes arrive unchanged (the GPU tests compare the model's outputs with HF's).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import cupy as cp
import numpy as np

_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice
_SLICE_BYTES = 8 << 20  # a host copy below this size runs on the calling thread
# Each staging buffer. Page-locking is paid at every start, in proportion to the size, while a
# larger buffer uploads no faster past a point: ``benchmarks/weight_upload.py`` compares sizes.
BUFFER_BYTES = 64 << 20


class UploadFailed(RuntimeError):
    """The background upload stopped on an error: some weights never reached the device."""


class PinnedUpload:
    """Uploads host arrays; ``buffer_bytes`` per staging buffer (two), ``threads`` host copiers.
    One upload: queue (``upload``, ``upload_stacked``), then ``start`` once, then ``finish``
    (or ``close`` to give up)."""

    def __init__(self, buffer_bytes: int = BUFFER_BYTES, threads: int = 8) -> None:
        self._size = buffer_bytes
        self._threads = threads
        self._device_id = cp.cuda.Device().id
        self._jobs: list[tuple[int, np.ndarray]] = []  # (device pointer, host bytes)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self.seconds: float | None = None  # start to the last byte landed, once finished

    @property
    def num_bytes(self) -> int:
        """The bytes queued."""
        return sum(host.nbytes for _, host in self._jobs)

    def upload(self, host: np.ndarray) -> cp.ndarray:
        """A device array with ``host``'s dtype and shape; its bytes arrive by ``finish``."""
        host = np.ascontiguousarray(host)
        out = cp.empty(host.shape, host.dtype)
        self._queue(out.data.ptr, host)
        return out

    def upload_stacked(self, hosts: list[np.ndarray]) -> cp.ndarray:
        """The arrays joined along their first axis (a fused projection's parts) in one device
        array, each part's bytes uploaded into its rows: no device-side concatenate."""
        hosts = [np.ascontiguousarray(host) for host in hosts]
        if not hosts:
            raise ValueError("upload_stacked needs at least one array")
        first = hosts[0]
        for host in hosts[1:]:
            if host.dtype != first.dtype or host.shape[1:] != first.shape[1:] or host.ndim < 1:
                raise ValueError(f"cannot stack {host.dtype}{list(host.shape)} under "
                                 f"{first.dtype}{list(first.shape)}")
        out = cp.empty((sum(host.shape[0] for host in hosts), *first.shape[1:]), first.dtype)
        offset = 0
        for host in hosts:
            self._queue(out.data.ptr + offset, host)
            offset += host.nbytes
        return out

    def _queue(self, device_ptr: int, host: np.ndarray) -> None:
        if self._thread is not None:
            raise RuntimeError("the upload has started: queue every array before start()")
        self._jobs.append((device_ptr, host.reshape(-1).view(np.uint8)))

    def start(self) -> None:
        """Move the queued bytes on a background thread (once; later calls do nothing)."""
        if self._thread is None:
            self._started = time.perf_counter()
            self._thread = threading.Thread(target=self._run, name="weights-upload",
                                            daemon=True)
            self._thread.start()

    def finish(self) -> None:
        """Start if not started, wait for every byte; ``UploadFailed`` if one never landed."""
        self.start()
        self._thread.join()
        if self._error is not None:
            raise UploadFailed(f"the weights' upload failed: {self._error}") from self._error
        if self._stopping.is_set():
            raise UploadFailed("the weights' upload was given up (close)")

    def close(self) -> None:
        """Give up what is not yet copied and wait for the copies in flight; no error."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        try:
            with cp.cuda.Device(self._device_id):
                self._copy_all()
            self.seconds = time.perf_counter() - self._started
        except BaseException as exc:  # handed to finish(): this thread has no caller
            self._error = exc

    def _copy_all(self) -> None:
        memory = [cp.cuda.alloc_pinned_memory(self._size) for _ in range(2)]
        views = [np.frombuffer(m, np.uint8, self._size) for m in memory]
        stream = cp.cuda.Stream(non_blocking=True)  # no implicit sync with the engine's work
        done: list[cp.cuda.Event | None] = [None, None]  # each buffer's last copies
        pending: list[tuple[int, int, int]] = []  # (device pointer, buffer offset, bytes)
        which, fill = 0, 0

        def flush() -> None:
            """Enqueue the filled buffer's copies; switch to the other buffer once its own last
            copies are done."""
            nonlocal which, fill
            if not pending:
                return
            base = memory[which].ptr
            for device_ptr, offset, num_bytes in pending:
                cp.cuda.runtime.memcpyAsync(device_ptr, base + offset, num_bytes,
                                            _HOST_TO_DEVICE, stream.ptr)
            event = cp.cuda.Event(disable_timing=True)
            event.record(stream)
            done[which] = event
            pending.clear()
            which, fill = which ^ 1, 0
            if done[which] is not None:
                done[which].synchronize()

        pool = ThreadPoolExecutor(self._threads, thread_name_prefix="weights-copy")
        try:
            for device_ptr, src in self._jobs:
                copied = 0
                while copied < src.nbytes:
                    if self._stopping.is_set():
                        return
                    if fill == self._size:
                        flush()
                    n = min(self._size - fill, src.nbytes - copied)
                    _host_copy(pool, self._threads, views[which][fill:fill + n],
                               src[copied:copied + n])
                    pending.append((device_ptr + copied, fill, n))
                    fill += n
                    copied += n
            flush()
        finally:
            stream.synchronize()  # no DMA reads a staging buffer after it is freed
            pool.shutdown()
            self._jobs = []


def _host_copy(pool: ThreadPoolExecutor, threads: int, dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src``, cut over the pool's threads when large."""
    if src.nbytes < 2 * _SLICE_BYTES:
        np.copyto(dst, src)
        return
    step = max(_SLICE_BYTES, -(-src.nbytes // threads))
    list(pool.map(lambda i: np.copyto(dst[i:i + step], src[i:i + step]),
                  range(0, src.nbytes, step)))
