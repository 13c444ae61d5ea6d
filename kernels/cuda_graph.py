"""CUDA graphs through CuPy stream capture, with a memory pool private to the graphs.

Why a private pool: a captured graph keeps the device addresses of every buffer it touched. If
those buffers came from CuPy's default pool, a later ``free_all_blocks`` (CuPy calls it on an
out-of-memory retry) could hand them back to the driver while the graph still writes them. The
graphs' pool is used only while capturing, so nothing else ever allocates from or frees it.
Graphs captured from one pool replay one at a time on one stream, so intermediates freed inside
one capture may be reused by the next capture. Hence nothing that one graph reads after another
graph's replay may be first allocated while capturing (or in the warm-up call before it): it
could sit in the other graph's scratch. Such buffers are made outside, e.g. at construction.
"""

from __future__ import annotations

from collections.abc import Callable

import cupy as cp

from kernels.ops import Array, CapturedGraph


class CudaGraph(CapturedGraph):
    """One captured graph; ``replay`` launches it on the current stream."""

    def __init__(self, graph: cp.cuda.graph.Graph, output: Array) -> None:
        self._graph = graph
        self.output = output

    def replay(self) -> Array:
        self._graph.launch(stream=cp.cuda.get_current_stream())
        return self.output


class GraphCapturer:
    """Captures callables on a side stream (capture cannot use the legacy default stream)."""

    def __init__(self) -> None:
        self._pool = cp.cuda.MemoryPool()
        self._stream = cp.cuda.Stream(non_blocking=True)

    def capture(self, fn: Callable[[], Array]) -> CudaGraph:
        caller = cp.cuda.get_current_stream()
        caller.synchronize()  # the captured inputs were written on the caller's stream
        with cp.cuda.using_allocator(self._pool.malloc), self._stream:
            fn()  # eager warm-up: NVRTC compiles, cuBLAS picks algorithms and its workspace
            self._stream.synchronize()
            self._stream.begin_capture()
            try:
                output = fn()
            finally:
                graph = self._stream.end_capture()
        return CudaGraph(graph, output)
