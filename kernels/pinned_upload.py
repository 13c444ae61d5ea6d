"""PinnedUpload: checkpoint tensors to the GPU through two pinned staging buffers.

``cp.asarray`` of a host array copies synchronously from pageable memory (the driver stages it
through a small pinned buffer of its own), one tensor after another: about 2.6 GB/s for a
Qwen3-4B checkpoint read from the page cache, most of a warm start. Here host threads copy the
tensor's bytes (from the checkpoint's memory map) into one pinned buffer while the device
copies the other one's bytes out (``cudaMemcpyAsync`` on the current stream), so the page cache,
the host copy and the bus work at once. Each ``upload`` ends with its copies enqueued on the
current stream, so later device work on that stream (a ``concatenate`` of the pieces of a fused
weight) sees the bytes; ``finish`` waits for the last copies and frees the buffers.

Not a kernel: a transfer, beside ``Ops.weight_from_host`` which uses it. No NumPy reference is
needed: the bytes arrive unchanged (the GPU tests compare the model's outputs with HF's).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import cupy as cp
import numpy as np

_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice
_SLICE_BYTES = 8 << 20  # a host copy below this size runs on the calling thread
# Each staging buffer. Page-locking is paid at every start, in proportion to the size, while a
# larger buffer uploads no faster past a point: ``benchmarks/weight_upload.py`` compares sizes.
BUFFER_BYTES = 64 << 20


class PinnedUpload:
    """Uploads host arrays; ``buffer_bytes`` per staging buffer (two), ``threads`` host copiers."""

    def __init__(self, buffer_bytes: int = BUFFER_BYTES, threads: int = 8) -> None:
        self._size = buffer_bytes
        self._memory = [cp.cuda.alloc_pinned_memory(buffer_bytes) for _ in range(2)]
        self._views = [np.frombuffer(m, np.uint8, buffer_bytes) for m in self._memory]
        self._done: list[cp.cuda.Event | None] = [None, None]  # each buffer's last copies
        self._which = 0
        self._fill = 0
        self._pending: list[tuple[int, int, int]] = []  # (device pointer, buffer offset, bytes)
        self._threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="weights-upload")

    def upload(self, host: np.ndarray) -> cp.ndarray:
        """A device array with ``host``'s dtype, shape and bytes (copies enqueued on the
        current stream)."""
        host = np.ascontiguousarray(host)
        out = cp.empty(host.shape, host.dtype)
        src = host.reshape(-1).view(np.uint8)
        done = 0
        while done < src.nbytes:
            if self._fill == self._size:
                self._flush()
            n = min(self._size - self._fill, src.nbytes - done)
            self._copy(self._views[self._which][self._fill:self._fill + n], src[done:done + n])
            self._pending.append((out.data.ptr + done, self._fill, n))
            self._fill += n
            done += n
        self._flush()
        return out

    def finish(self) -> None:
        """Wait for every copy; the staging buffers and threads are released."""
        self._flush()
        cp.cuda.get_current_stream().synchronize()
        self._pool.shutdown()
        self._memory, self._views, self._done = [], [], [None, None]

    def _copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        if src.nbytes < 2 * _SLICE_BYTES:
            np.copyto(dst, src)
            return
        step = max(_SLICE_BYTES, -(-src.nbytes // self._threads))
        list(self._pool.map(lambda i: np.copyto(dst[i:i + step], src[i:i + step]),
                            range(0, src.nbytes, step)))

    def _flush(self) -> None:
        """Enqueue the filled buffer's copies; switch to the other buffer once its own last
        copies are done."""
        if not self._pending:
            return
        stream = cp.cuda.get_current_stream()
        base = self._memory[self._which].ptr
        for device_ptr, offset, num_bytes in self._pending:
            cp.cuda.runtime.memcpyAsync(device_ptr, base + offset, num_bytes, _HOST_TO_DEVICE,
                                        stream.ptr)
        event = cp.cuda.Event(disable_timing=True)
        event.record(stream)
        self._done[self._which] = event
        self._pending = []
        self._which ^= 1
        self._fill = 0
        if self._done[self._which] is not None:
            self._done[self._which].synchronize()
