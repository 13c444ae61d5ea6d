"""A staging buffer in the engine's own device memory: vLLM's many small pieces packed there.

vLLM's flash-attention layout splits a 2.36 MB block into 72 pieces of 32 KiB (K and V of each
layer). The daemon copying them itself moves them as 72 small DMA runs a block (a third of the
bus at 64 blocks), or packs them with a kernel in its own CUDA context, which time-slices against
the engine's step. Here the worker packs a save's blocks into whole-block slots with one
``copy_pieces`` launch on a stream of its own, behind the step that computed them (one
context, no time-slicing; a few SMs beside the next steps), and the daemon moves each slot as
one run; a load lands in slots and one launch scatters them into the engine's blocks on the
engine's current stream, queued before its next forward.

The buffer is one torch allocation registered with the daemon by CUDA IPC as a one-region,
block-major layout (slot ``i`` is block ``i``). Slots are taken and given back explicitly; a
slot given back while a launch that reads or writes it may still run on the device goes back to
the free list only once an event recorded after that launch has completed. CuPy launches the
kernel (the project's ``cuda12``/``cuda13`` extra), on torch's stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kernels.block_copy import launch_pieces, region_table
from kvstore.layout import KVLayout, Region
from offload.external.ipc_handle import cuda_ipc_handle
from offload.external.slot_pool import SlotPool

# A save's pack runs beside the engine's compute in at most this many CTAs (256 threads each):
# of 32 and 128 on an H200, 128 saved faster (0.53 against 0.46 of raw at 64 blocks) at no
# measurable cost to vLLM's step (benchmarks/results/*-staged-wide-s25d-*).
PACK_CTAS = 128


def packing_unavailable() -> str | None:
    """Why this environment cannot launch the staging's copies (CuPy, or the kernel module's
    ``ml_dtypes``, does not import), or None. Both come with the cuda12/cuda13 extras."""
    try:
        import cupy  # noqa: F401
        import ml_dtypes  # noqa: F401
    except ImportError as exc:
        return str(exc) or "CuPy or ml_dtypes does not import"
    return None


def cupy_stream(cupy: Any, stream: Any, device_index: int) -> Any:
    """Torch's ``stream`` as CuPy's: through the CUDA stream protocol where both know it
    (``ExternalStream`` is deprecated in CuPy 14), else by its handle."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cupy.cuda.ExternalStream(int(stream.cuda_stream), device_index)


class DeviceStaging:
    """``num_slots`` whole blocks of ``block_bytes`` on ``device`` (torch's), packed from and
    scattered to the engine's pieces, whose absolute device addresses of block 0, strides and
    sizes (in a block's byte order) are ``piece_base``, ``piece_stride``, ``piece_bytes``."""

    def __init__(self, num_slots: int, piece_base: Sequence[int], piece_stride: Sequence[int],
                 piece_bytes: Sequence[int], device: Any, pack_ctas: int = PACK_CTAS) -> None:
        reason = packing_unavailable()
        if reason is not None:
            raise RuntimeError(f"device staging (device_staging_blocks) launches its copies "
                               f"with CuPy, which this environment cannot ({reason}): install "
                               f"the project's cuda13 extra (cuda12 for CUDA 12), or set "
                               f"device_staging_blocks to 0")
        import cupy
        import torch

        if num_slots <= 0 or pack_ctas <= 0:
            raise ValueError("a staging buffer needs at least one slot and one CTA to pack")
        sizes = np.asarray(piece_bytes, dtype=np.int64)
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        table = region_table(piece_base, piece_stride, sizes, offsets)  # ValueError: unaligned
        self.num_slots = num_slots
        self.block_bytes = int(sizes.sum())
        self.max_piece_bytes = int(sizes.max())
        self.num_regions = len(sizes)
        self._torch, self._cupy = torch, cupy
        self.device = torch.device(device)
        self.buffer = torch.empty(num_slots * self.block_bytes, dtype=torch.uint8,
                                  device=self.device)
        self.handle, self.offset = cuda_ipc_handle(int(self.buffer.data_ptr()))
        with cupy.cuda.Device(self.device.index or 0):
            self._regions = cupy.asarray(table)
        # Saves pack on a stream of their own, at CUDA's lowest priority (0, the default's: an
        # engine that raises its compute streams' priority keeps it ahead).
        self._side = torch.cuda.Stream(device=self.device, priority=0)
        self.pack_ctas = pack_ctas
        self.pool = SlotPool(num_slots)
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile (or load from CuPy's cache) and run the copy kernel once, packing the
        engine's block 0 into slot 0 (it only reads the engine's memory; one function packs
        and scatters): a module that cannot build fails here, at registration, and the first
        save or load does not wait for a compile inside a step."""
        with self._torch.cuda.device(self.device):
            self._launch([0], [0], pack=True)
            self._torch.cuda.current_stream(self.device).synchronize()

    def layout(self, dtype: str, meta: dict) -> KVLayout:
        """The registration: one region over the buffer, slot ``i`` at ``i * block_bytes``."""
        size = self.num_slots * self.block_bytes
        region = Region(handle=self.handle, size_bytes=self.offset + size, offset=self.offset,
                        block_stride=self.block_bytes, block_bytes=self.block_bytes)
        return KVLayout(num_blocks=self.num_slots, regions=(region,),
                        device=f"cuda:{self.device.index or 0}", dtype=dtype, meta=meta)

    @property
    def num_free(self) -> int:
        """Slots free now (those whose last launch has not completed yet not counted)."""
        return self.pool.num_free

    def take(self, num_slots: int) -> list[int] | None:
        """``num_slots`` free slots, or None when fewer are free (nothing taken)."""
        return self.pool.take(num_slots)

    def give_back(self, slots: list[int]) -> None:
        """The slots are free once every launch queued on the current stream so far (a load's
        scatter from them included) has completed. A save's slots come back only after the
        save ended, and a save is sent only once its pack completed (``Slots.ready``), so the
        pack's own stream needs no event here."""
        if slots:
            self.pool.give_back(slots, after=self._record())

    def pack(self, block_ids: Sequence[int], slots: Sequence[int]) -> Callable[[], bool]:
        """Queue the copy of the engine's ``block_ids`` into ``slots``, behind everything queued
        on torch's current stream so far (the step that wrote them) but on a low-priority stream
        of its own, in at most ``pack_ctas`` CTAs: it runs beside the next steps' compute
        instead of in front of it, and needs only a few SMs to outrun the bus. Returns whether
        it has completed."""
        behind = self._record()
        with self._torch.cuda.stream(self._side):
            self._side.wait_event(behind)
            event = self._launch(block_ids, slots, pack=True, max_ctas=self.pack_ctas)
        return event.query

    def unpack(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Queue, on torch's current stream, the copy of ``slots`` into the engine's
        ``block_ids``, with the whole device: a forward queued after it on that stream reads
        the blocks."""
        self._launch(block_ids, slots, pack=False)

    def _launch(self, block_ids: Sequence[int], slots: Sequence[int], pack: bool,
                max_ctas: int | None = None) -> Any:
        """Launch on torch's current stream; an event recorded after it."""
        if len(block_ids) != len(slots):
            raise ValueError(f"{len(block_ids)} blocks for {len(slots)} slots")
        if any(not 0 <= s < self.num_slots for s in slots):
            raise ValueError(f"a slot outside 0..{self.num_slots - 1}")
        cupy, torch = self._cupy, self._torch
        stream = torch.cuda.current_stream(self.device)
        if len(block_ids):
            ids = np.empty((2, len(block_ids)), dtype=np.int64)
            ids[0], ids[1] = block_ids, slots
            # Up through pinned memory, queued on the stream: a copy from pageable memory (what
            # cupy.asarray does) first waits on the host for everything queued on the stream,
            # the step included. Torch keeps the pinned buffer until the copy ran, and the
            # device table is freed in the stream's order, after the launch.
            table = torch.from_numpy(ids).pin_memory().to(self.device, non_blocking=True)
            with cupy.cuda.Device(self.device.index or 0):
                on = cupy_stream(cupy, stream, self.device.index or 0)
                launch_pieces(int(self._regions.data.ptr), self.num_regions,
                              int(table.data_ptr()), len(block_ids),
                              int(self.buffer.data_ptr()), self.block_bytes,
                              self.max_piece_bytes, pack, on,
                              slots_ptr=int(table.data_ptr()) + 8 * len(block_ids),
                              max_ctas=max_ctas)
        return self._record()

    def _record(self) -> Any:
        event = self._torch.cuda.Event()
        event.record(self._torch.cuda.current_stream(self.device))
        return event

