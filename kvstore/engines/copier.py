"""Batched block copies between a registered engine's GPU KV memory and the pinned host pool.

The daemon opens each engine's CUDA IPC handle once per registration (``cuda_ipc``) and moves
blocks with ``CudaCopier``: one non-blocking stream per direction, copies coalesced into the fewest
runs (a block of the block-major arena is one contiguous run, so a batch of
blocks is at most one call per block and fewer when block ids are consecutive), and a CUDA event
recorded after the batch. Completion is the event, never a sleep loop. Device-to-device copies
(the HBM tier: one engine's arena into another's) run on a third stream of their own.

One 2.36 MB block per call reaches about 93% of one big memcpy on an H100 (the copy engine idles a
few microseconds between calls); dealing the calls over two streams of the same direction did not
close that gap (measured: 47-51 GB/s either way against 55 raw), so there is one stream.

Batches arrive as ``RunArrays`` (NumPy, built by a registration's ``PieceTable``) or as a list of
``CopyRun``; either way they are coalesced vectorised and handed on without a Python object per
run: many small runs (vLLM's 32 KiB pieces) are gathered on the GPU by one ``copy_runs`` launch
(its table read in place from a pinned slot, ``PinnedTables``) into a device staging buffer that
crosses the bus a run per block (``device_staging``), large ones (kvengine's block-major blocks)
go to one ``cuMemcpyBatchAsync`` (the copy engines, without a driver call per block). Those are
the defaults: the copier's ``CopySettings`` (``copy_settings``) choose the method per batch shape
(``copy_method``), and a save runs no kernel unless ``save_kernels`` (its batch of small runs goes
to one ``cuMemcpyBatchAsync``): a kernel in the daemon's context time-slices against the step.

Whole blocks of a registration (``blocks_to_host`` / ``blocks_to_device``, what saves and loads
use) skip the runs where the layout has several pieces a block (loads; saves only with
``save_kernels``): they are packed on the GPU through a staging slot (``packed_blocks``).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Sequence

import numpy as np

from kvstore.engines import cuda_batch
from kvstore.engines.copy_bounds import check_block_ids
from kvstore.engines.copy_handle import CopyHandle, CopyWaits
from kvstore.engines.copy_method import GATHER_MIN_RUNS, aligned, host_method
from kvstore.engines.copy_settings import CopyMethod, CopySettings
from kvstore.engines.copy_timing import CopyTiming
from kvstore.engines.cuda_fault import CudaFault
from kvstore.engines.cuda_ipc import hold_primary_context
from kvstore.engines.device_staging import DeviceStaging, staged_parts, staged_sides
from kvstore.engines.packed_blocks import RegionTables, enqueue_packed
from kvstore.engines.run_arrays import CopyRun, PieceTable, RunArrays, coalesce_arrays
from kvstore.engines.table_staging import PinnedTables

__all__ = ["CopyHandle", "CudaCopier"]

_MEMCPY_HOST_TO_DEVICE = 1
_MEMCPY_DEVICE_TO_HOST = 2
_MEMCPY_DEFAULT = 4  # direction from the (unified) addresses: device to device, peers included
# how ``counts`` names a submission's direction (``save_batch``, ``load_staged``, ...)
_DIRECTIONS = {_MEMCPY_DEVICE_TO_HOST: "save", _MEMCPY_HOST_TO_DEVICE: "load",
               _MEMCPY_DEFAULT: "device"}
_CUDA_MEMORY_TYPE_HOST = 1


def _cupy():
    import cupy  # imported lazily: the CPU daemon never needs it

    return cupy


Runs = Sequence[CopyRun] | RunArrays


def _merged(runs: Runs) -> RunArrays:
    return coalesce_arrays(runs if isinstance(runs, RunArrays) else RunArrays.of(runs))


class CudaCopier:
    """Per-device copy streams (one per direction, one for device to device, each with a side
    stream for the staged method's kernels); a submission enqueues coalesced runs and returns
    an event handle, by the methods ``settings`` choose. Thread-safe: a lock per direction.
    Every CUDA call runs with ``device_id`` current, whatever thread submits. Once ``fault``
    (the process's, shared by every copier) is poisoned, submissions raise ContextPoisoned
    without calling CUDA."""

    def __init__(self, device_id: int, settings: CopySettings = CopySettings(),
                 fault: CudaFault | None = None) -> None:
        cp = _cupy()
        self.device_id = device_id
        self.settings = settings
        self.fault = fault if fault is not None else CudaFault()
        self._waits = CopyWaits(settings.wait_poll_us / 1e6, self.fault)
        kinds = (_MEMCPY_DEVICE_TO_HOST, _MEMCPY_HOST_TO_DEVICE, _MEMCPY_DEFAULT)
        hold_primary_context(device_id)  # made, if new, without the GIL
        with cp.cuda.Device(device_id):
            self._streams = {kind: cp.cuda.Stream(non_blocking=True) for kind in kinds}
            # the staged method's gather/scatter kernels, beside each host <-> device stream
            self._side_streams = {kind: cp.cuda.Stream(non_blocking=True) for kind in kinds}
        self._locks = {kind: threading.Lock() for kind in kinds}
        self._tables = {kind: PinnedTables() for kind in kinds}
        self._staging = {kind: DeviceStaging(max_slot_bytes=settings.staging_slot_bytes)
                         for kind in kinds}
        self.regions = RegionTables(device_id)  # each piece table's, for copy_pieces
        # how whole-block batches went: per way (save, load, device) the blocks asked for
        # (``*_blocks``), the copies made of them and of other runs (``*_runs``), the methods
        self.counts: Counter[str] = Counter()
        self.timing = CopyTiming()  # where the pipelines' saves and loads spent their time

    def _submit(self, runs: RunArrays, kind: int, method: CopyMethod) -> CopyHandle:
        """Enqueue the (coalesced) runs on the ``kind`` stream by ``method``; an event after
        the last of them is the handle."""
        cp = _cupy()
        stream = self._streams[kind]
        self.fault.check()
        with cp.cuda.Device(self.device_id), self._locks[kind]:
            way = _DIRECTIONS[kind]
            self.counts[f"{way}_{method.value}"] += 1
            # the copies it makes after coalescing (adjacent blocks on both sides make one)
            self.counts[f"{way}_runs"] += len(runs)
            try:
                if method is CopyMethod.STAGED:
                    # A part per staging slot; the streams keep the parts in order, so the last
                    # part's event is after every part's copies.
                    for part in staged_parts(runs, self._staging[kind].max_slot_bytes):
                        event = self._staged(part, kind)
                    return self._waits.handle(event, runs.total_bytes,
                                              self._waits.queued(kind, runs.total_bytes))
                kernel = method is CopyMethod.KERNEL
                slot = self._launch(runs, kind, stream) if kernel else None
                if not kernel:
                    self._bus_copy(runs, kind, method is CopyMethod.BATCH)
                # Inside the try: a failure to record leaves copies without an event to wait on.
                event = cp.cuda.Event(block=True, disable_timing=True)
                event.record(stream)
                if slot is not None:
                    PinnedTables.retire(slot, event)
                earliest_end = self._waits.queued(kind, runs.total_bytes)
            except BaseException as exc:
                self.fault.observe(exc, f"submitting copies on device {self.device_id}")
                self._drain(kind)
                raise
        return self._waits.handle(event, runs.total_bytes, earliest_end)

    def _drain(self, kind: int) -> None:
        """After a failed submission, wait out the copies it enqueued (they have no event): none
        still touches the caller's buffers once it hears of the error."""
        for s in (self._streams[kind], self._side_streams[kind]):
            with contextlib.suppress(Exception):
                s.synchronize()

    def _bus_copy(self, runs: RunArrays, kind: int, batch: bool) -> None:
        """The runs on the copy engines: one driver batch, or a ``cudaMemcpyAsync`` each."""
        stream = self._streams[kind]
        if batch and len(runs) > 1:
            cuda_batch.memcpy_batch(runs, stream.ptr, kind != _MEMCPY_HOST_TO_DEVICE,
                                    kind != _MEMCPY_DEVICE_TO_HOST, self.device_id,
                                    keep_gil=self.settings.batch_keeps_gil)
            return
        for src, dst, num_bytes in runs.triples():
            _cupy().cuda.runtime.memcpyAsync(dst, src, num_bytes, kind, stream.ptr)

    def _staged(self, runs: RunArrays, kind: int):
        """Enqueue a batch through a device staging buffer; the event after its last step.

        Save: gather kernel (side stream) -> event -> bus copy (copy stream). Load: bus copy
        -> event -> scatter kernel (side stream). The buffer's previous batch is waited for on
        the GPU by the stream that writes it first."""
        cp = _cupy()
        to_device = kind == _MEMCPY_HOST_TO_DEVICE
        copy_stream, side = self._streams[kind], self._side_streams[kind]
        first, second = (copy_stream, side) if to_device else (side, copy_stream)
        staging = self._staging[kind].take(runs.total_bytes)
        bus, device = staged_sides(runs, staging.memory.ptr, to_device)
        if staging.event is not None:
            first.wait_event(staging.event)
        batch = cuda_batch.available()
        table = None if to_device else self._launch(device, kind, side)
        if to_device:
            self._bus_copy(bus, kind, batch)
        middle = cp.cuda.Event(disable_timing=True)
        middle.record(first)
        second.wait_event(middle)
        if to_device:
            table = self._launch(device, kind, side)
        else:
            self._bus_copy(bus, kind, batch)
        event = cp.cuda.Event(block=True, disable_timing=True)
        event.record(second)
        staging.event = event
        if table is not None:
            PinnedTables.retire(table, event)
        return event

    def _launch(self, runs: RunArrays, kind: int, stream):
        """One ``copy_runs`` launch; its table in a pinned slot (returned: guard it with the
        launch's event) or, where pinned memory is not mapped, uploaded."""
        from kernels.block_copy import blocks_per_run_for, launch_table, run_table

        table = run_table(runs.src_ptrs, runs.dst_ptrs, runs.num_bytes)
        unroll = self.settings.kernel_unroll
        # Between arenas the grid is capped: short CTAs, one per 16 KiB, left HBM half used.
        blocks_per_run = blocks_per_run_for(int(table[2].max()), unroll, len(runs) if
                                            kind == _MEMCPY_DEFAULT else None)
        staged = self._tables[kind].take(table)
        if staged is None:
            with stream:
                dev_table = _cupy().asarray(table)  # freed into the stream-ordered pool
                launch_table(dev_table.data.ptr, len(runs), stream, blocks_per_run, unroll)
            return None
        ptr, slot = staged
        launch_table(ptr, len(runs), stream, blocks_per_run, unroll)
        return slot

    def blocks_to_host(self, table: PieceTable, block_ids: Sequence[int] | np.ndarray,
                       host_addrs: Sequence[int] | np.ndarray) -> CopyHandle:
        """Save direction, whole blocks: engine block ``block_ids[i]`` (its pieces as ``table``
        places them) -> the ``table.block_bytes`` at ``host_addrs[i]``."""
        return self._blocks(table, block_ids, host_addrs, _MEMCPY_DEVICE_TO_HOST)

    def blocks_to_device(self, table: PieceTable, block_ids: Sequence[int] | np.ndarray,
                         host_addrs: Sequence[int] | np.ndarray) -> CopyHandle:
        """Load direction, whole blocks: ``host_addrs[i]`` -> engine block ``block_ids[i]``."""
        return self._blocks(table, block_ids, host_addrs, _MEMCPY_HOST_TO_DEVICE)

    def _blocks(self, table: PieceTable, block_ids, host_addrs, kind: int) -> CopyHandle:
        """Packed (``copy_pieces`` through a staging slot) where the layout, the host memory
        and the staging budget allow it, else the batch's runs by ``_host_method``."""
        ids = np.asarray(block_ids, dtype=np.int64)
        host = np.asarray(host_addrs, dtype=np.int64)
        if len(ids) != len(host):
            raise ValueError(f"{len(host)} host addresses for {len(ids)} blocks")
        check_block_ids(ids, table.num_blocks)
        with self._locks[kind]:  # the submission takes it after this
            self.counts[f"{_DIRECTIONS[kind]}_blocks"] += len(ids)
        regions = self._packable(table, host, kind)
        if regions is None:
            runs = table.runs(ids, host, to_device=kind == _MEMCPY_HOST_TO_DEVICE)
            if kind == _MEMCPY_HOST_TO_DEVICE:
                return self.host_to_device(runs)
            return self.device_to_host(runs)
        self.counts["batches_packed"] += 1
        return self._submit_packed(table, regions, ids, host, kind)

    def _packable(self, table: PieceTable, host: np.ndarray, kind: int):
        """The table's device region table when this batch can go packed, else None (a
        multi-piece layout's batch that cannot is counted: ``counts``)."""
        if not len(host) or table.num_pieces < self.settings.packed_min_pieces:
            return None
        if kind == _MEMCPY_DEVICE_TO_HOST and not self.settings.save_kernels:
            return None  # saves stay on the copy engines (CopySettings.save_kernels)
        if table.block_bytes > self._staging[kind].max_slot_bytes or np.any(host & 15) or \
                not all(self._device_addressable(int(p)) for p in {host[0], host[-1]}):
            self.counts["batches_not_packed_host"] += 1  # pageable, unaligned or too large
            return None
        regions = self.regions.get(table)
        if regions is None:
            self.counts["batches_not_packed_layout"] += 1
        return regions

    def _submit_packed(self, table: PieceTable, regions, ids: np.ndarray, host: np.ndarray,
                       kind: int) -> CopyHandle:
        """Enqueue whole blocks packed (``packed_blocks``), in parts of at most a staging
        slot; the last part's event is after every part's copies (the streams keep them in
        order)."""
        cp = _cupy()
        per_part = self._staging[kind].max_slot_bytes // table.block_bytes
        batch = cuda_batch.available()
        self.fault.check()
        with cp.cuda.Device(self.device_id), self._locks[kind]:
            try:
                for start in range(0, len(ids), per_part):
                    part = slice(start, start + per_part)
                    event = enqueue_packed(
                        table, regions, ids[part], host[part],
                        to_device=kind == _MEMCPY_HOST_TO_DEVICE,
                        copy_stream=self._streams[kind], side_stream=self._side_streams[kind],
                        staging=self._staging[kind], id_tables=self._tables[kind],
                        bus_copy=lambda bus: self._bus_copy(bus, kind, batch),
                        unroll=self.settings.kernel_unroll)
                earliest_end = self._waits.queued(kind, len(ids) * table.block_bytes)
            except BaseException as exc:
                self.fault.observe(exc, f"submitting copies on device {self.device_id}")
                self._drain(kind)
                raise
        return self._waits.handle(event, len(ids) * table.block_bytes, earliest_end)

    def device_to_host(self, runs: Runs) -> CopyHandle:
        """Save direction: engine HBM → pinned pool."""
        merged = _merged(runs)
        return self._submit(merged, _MEMCPY_DEVICE_TO_HOST,
                            self._host_method(merged, merged.dst_ptrs, _MEMCPY_DEVICE_TO_HOST))

    def host_to_device(self, runs: Runs) -> CopyHandle:
        """Load direction: pinned pool → engine HBM."""
        merged = _merged(runs)
        return self._submit(merged, _MEMCPY_HOST_TO_DEVICE,
                            self._host_method(merged, merged.src_ptrs, _MEMCPY_HOST_TO_DEVICE))

    def _host_method(self, merged: RunArrays, host_ptrs: np.ndarray, kind: int) -> CopyMethod:
        """How a host <-> device batch goes (``copy_method.host_method``)."""
        def addressable() -> bool:
            return all(self._device_addressable(int(p)) for p in {host_ptrs[0], host_ptrs[-1]})

        return host_method(self.settings, merged, save=kind == _MEMCPY_DEVICE_TO_HOST,
                           host_addressable=addressable,
                           max_slot_bytes=self._staging[kind].max_slot_bytes,
                           batch_available=cuda_batch.available())

    def _device_addressable(self, host_ptr: int) -> bool:
        cp = _cupy()
        try:
            with cp.cuda.Device(self.device_id):
                attrs = cp.cuda.runtime.pointerGetAttributes(host_ptr)
        except Exception:  # not known to CUDA: plain pageable memory
            return False
        return attrs.type == _CUDA_MEMORY_TYPE_HOST and attrs.devicePointer == host_ptr

    def device_to_device(self, runs: Runs, peer: bool = False) -> CopyHandle:
        """HBM tier: one engine's arena → another's, on this (the destination's) device.

        Few runs go as ``cudaMemcpyAsync`` calls; many by one ``copy_runs`` launch (a call costs
        ~5 us, more than a 2 MB block takes at HBM speed; a driver batch of 256 runs took longer
        to submit than to copy). ``peer`` (a source on another device): every run on the copy
        engines, faster over NVLink than the kernel."""
        return self._submit(*self.device_to_device_plan(runs, peer))

    def device_to_device_plan(self, runs: Runs, peer: bool = False
                              ) -> tuple[RunArrays, int, CopyMethod]:
        """The merged runs, the copy kind and the method ``device_to_device`` submits them by."""
        merged = _merged(runs)
        gather = not peer and len(merged) >= GATHER_MIN_RUNS and aligned(merged)
        return merged, _MEMCPY_DEFAULT, CopyMethod.KERNEL if gather else CopyMethod.MEMCPY
