"""Whole blocks of a multi-piece layout packed on the GPU: the copier's packed path.

A layout with several pieces a block (vLLM's: a K and a V piece per layer) is not moved as a run
per piece. One ``copy_pieces`` launch packs (save) or unpacks (load) the blocks between the
engine's memory and a device staging slot, from a table of block ids and the layout's region
table (uploaded once per ``PieceTable``: ``RegionTables``), and the slot crosses the bus a run
per block or fewer (``enqueue_packed``). The kernel runs on the direction's side stream, ordered
against its copy stream by an event on the GPU, so the next part's pack overlaps this part's
transfer. Building, merging and uploading a run per piece had paced vLLM's saves at ~1 ms per
13-block chunk of Python against 0.56 ms on the bus (H100, ``benchmarks/copy_trace.py``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable

import numpy as np

from kvstore.engines.device_staging import DeviceStaging
from kvstore.engines.run_arrays import PieceTable, RunArrays, coalesce_arrays
from kvstore.engines.table_staging import PinnedTables

log = logging.getLogger(__name__)


class RegionTables:
    """Each piece table's ``copy_pieces`` region table on one device, uploaded on first use
    and complete before any stream reads it; held as long as its table lives. Thread-safe."""

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id
        self._tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __contains__(self, table: PieceTable) -> bool:
        with self._lock:
            return table in self._tables

    def get(self, table: PieceTable):
        """The table's device region table; None (logged once per table) when its pieces are
        not 16-byte aligned: its blocks then go by runs."""
        with self._lock:
            if table not in self._tables:
                self._tables[table] = self._upload(table)
            return self._tables[table]

    def _upload(self, table: PieceTable):
        from kernels.block_copy import region_table

        try:
            regions = region_table(table.device_base, table.device_stride, table.piece_bytes,
                                   table.host_offset)
        except ValueError as exc:
            log.warning("a layout's blocks go by runs, not packed: %s", exc)
            return None
        import cupy as cp

        with cp.cuda.Device(self.device_id):
            uploaded = cp.asarray(regions)  # on the current stream: the copier's streams do
            cp.cuda.get_current_stream().synchronize()  # not wait for it (once per table)
            return uploaded


def enqueue_packed(table: PieceTable, regions, ids: np.ndarray, host: np.ndarray, *,
                   to_device: bool, copy_stream, side_stream, staging: DeviceStaging,
                   id_tables: PinnedTables, bus_copy: Callable[[RunArrays], None],
                   unroll: int):
    """Enqueue one staging slot's worth of blocks ``ids`` <-> the host blocks at ``host``;
    returns the event after its last step. Save: ``copy_pieces`` packs them (side stream) ->
    event -> the slot crosses the bus (``bus_copy`` on the copy stream). Load: the reverse. The
    slot's previous batch is waited for on the GPU by the stream that writes it first. Call
    with the copy stream's lock held and the device current."""
    import cupy as cp

    from kernels.block_copy import launch_pieces

    first, second = (copy_stream, side_stream) if to_device else (side_stream, copy_stream)
    block_bytes = table.block_bytes
    slot = staging.take(len(ids) * block_bytes)
    packed = slot.memory.ptr + np.arange(len(ids), dtype=np.int64) * block_bytes
    sizes = np.full(len(ids), block_bytes, dtype=np.int64)
    bus = coalesce_arrays(RunArrays(host, packed, sizes) if to_device
                          else RunArrays(packed, host, sizes))
    if slot.event is not None:
        first.wait_event(slot.event)
    ids_slot = id_tables.take(ids)
    uploaded = None
    if ids_slot is None:  # pinned memory not mapped: the ids go up stream-ordered
        with side_stream:
            uploaded = cp.asarray(ids)
    ids_ptr = uploaded.data.ptr if uploaded is not None else ids_slot[0]

    def pack_or_unpack() -> None:
        launch_pieces(regions.data.ptr, regions.shape[1], ids_ptr, len(ids), slot.memory.ptr,
                      block_bytes, int(table.piece_bytes.max()), not to_device, side_stream,
                      unroll)

    if to_device:
        bus_copy(bus)
    else:
        pack_or_unpack()
    middle = cp.cuda.Event(disable_timing=True)
    middle.record(first)
    second.wait_event(middle)
    if to_device:
        pack_or_unpack()
    else:
        bus_copy(bus)
    event = cp.cuda.Event(block=True, disable_timing=True)
    event.record(second)
    slot.event = event
    if ids_slot is not None:
        PinnedTables.retire(ids_slot[1], event)
    return event
