"""A GPU engine's registration: its KV regions opened by CUDA IPC handle, moved by its pipeline.

A CUDA region's size is checked against the allocation size the driver reports for the opened
IPC mapping, never taken on the engine's word. A handle is open for one live registration at a
time (``IpcTable``): a second registration of it, from any connection, is refused, so holding a
copy of another engine's handle gains nobody a way to write into that engine's memory (which
only its own connection's registration may do). Regions of one registration may share a handle
(one mapping). Once its regions
are mapped the registration owns a ``CopyPipeline`` over the device's ``CudaCopier`` and its
``PieceTable`` (NumPy arrays computed once): saves and loads are its pipelined batches. Importable
without CuPy: nothing here touches it until a CUDA layout is registered.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from kvstore.engines.copier import CudaCopier
from kvstore.engines.copy_pipeline import CopyPipeline
from kvstore.engines.cuda_ipc import CudaIpcMapping, cuda_available
from kvstore.engines.registration import (
    Cancellation,
    Registration,
    RegistryError,
    host_address,
)
from kvstore.engines.run_arrays import PieceTable
from kvstore.layout import KVLayout
from kvstore.store.block_store import BlockStore, Lease

log = logging.getLogger(__name__)

_CUDA_DEVICE = re.compile(r"^cuda(?::(\d{1,3}))?$")
CUDA_IPC_HANDLE_BYTES = 64


class HandleInUse(RegistryError):
    """A CUDA IPC handle a live registration holds: registered once, by its own engine."""

    def __init__(self, what: str) -> None:
        super().__init__("permission_denied", f"{what}: its CUDA IPC handle is registered "
                         "already, and a handle is registered once while that registration "
                         "lives (its engine's connection owns it)")

# A forced fault (tests): no mapping of this process lies 16 TiB past an engine's arena.
_CORRUPT_OFFSET = 1 << 44


class IpcTable:
    """CUDA IPC mappings open in this process, by (device, handle): one registration each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[int, bytes], CudaIpcMapping | None] = {}  # None: being opened

    def acquire(self, handle: bytes, size_bytes: int, device_id: int,
                what: str) -> CudaIpcMapping:
        """Open ``handle`` for one registration; HandleInUse if another one holds it."""
        key = (device_id, handle)
        with self._lock:
            if key in self._open:
                raise HandleInUse(what)
            self._open[key] = None  # claimed: a concurrent registration of it is refused too
        try:
            mapping = CudaIpcMapping(handle, size_bytes, device_id)
        except BaseException:
            with self._lock:
                del self._open[key]
            raise
        with self._lock:
            self._open[key] = mapping
        return mapping

    def release(self, handle: bytes, device_id: int) -> None:
        with self._lock:
            mapping = self._open.pop((device_id, handle))
        if mapping is None:
            return
        try:
            mapping.close()
        except Exception as exc:  # a broken CUDA context: nothing left to unmap
            log.warning("closing a CUDA IPC mapping on device %d failed: %s", device_id, exc)


def cuda_device_id(device: str) -> int:
    """The device index ``device`` ("cuda" or "cuda:N") names; RegistryError if unusable."""
    match = _CUDA_DEVICE.match(device)
    if match is None:
        raise RegistryError("bad_request", f"unknown device {device!r}")
    device_id = int(match.group(1) or 0)
    if not cuda_available():
        raise RegistryError("unsupported", f"device {device!r}: CUDA IPC regions need a CUDA "
                            "device and this daemon sees none (CuPy missing or no GPU); register "
                            "a CPU shared-memory layout")
    import cupy

    num_devices = cupy.cuda.runtime.getDeviceCount()
    if device_id >= num_devices:
        raise RegistryError("bad_request", f"device {device!r}: this daemon sees "
                            f"{num_devices} CUDA device(s)")
    return device_id


class CudaRegistration(Registration):
    """One device address per region; device memory stays mapped until ``close`` and the last
    copy."""

    is_cuda = True

    def __init__(self, registration_id: int, engine_id: str, layout: KVLayout, owner: str,
                 device_id: int, copier: CudaCopier, ipc_table: IpcTable) -> None:
        super().__init__(registration_id, engine_id, layout, owner)
        self.device_id = device_id
        self.copier = copier
        self._ipc_table = ipc_table
        self._region_ptrs: list[int] = []  # one per region
        self._ipc_handles: list[bytes] = []  # distinct, acquired
        self._pipeline: CopyPipeline | None = None  # once every region is mapped
        # The regions opened again on other devices, for their engines' HBM-tier copies.
        self._peer_lock = threading.Lock()
        self._peer_ptrs: dict[int, list[int]] = {}
        self._peer_handles: list[tuple[bytes, int]] = []  # (handle, device), acquired

    @classmethod
    def open(cls, ids: Iterator[int], engine_id: str, layout: KVLayout, owner: str,
             copier_of: Callable[[int], CudaCopier], ipc_table: IpcTable,
             corrupt: bool = False) -> CudaRegistration:
        """Open every region's IPC handle; RegistryError (nothing left mapped) if one fails.
        The id is drawn from ``ids`` only once the layout names a usable device and handles.
        ``corrupt`` (tests only): copies address the regions ``_CORRUPT_OFFSET`` past them."""
        device_id = cuda_device_id(layout.device)
        handles = []
        for i, region in enumerate(layout.regions):
            if not isinstance(region.handle, bytes) or len(region.handle) != \
                    CUDA_IPC_HANDLE_BYTES:
                raise RegistryError("bad_request", f"region {i}: a CUDA region's handle must be "
                                    f"the {CUDA_IPC_HANDLE_BYTES} bytes of a CUDA IPC handle")
            handles.append(region.handle)
        reg = cls(next(ids), engine_id, layout, owner, device_id, copier_of(device_id),
                  ipc_table)
        mapped: dict[bytes, int] = {}
        try:
            for i, handle in enumerate(handles):
                if handle not in mapped:
                    size = max(r.size_bytes for r, h in zip(layout.regions, handles)
                               if h == handle)
                    try:
                        mapping = ipc_table.acquire(handle, size, device_id, f"region {i}")
                    except RegistryError:
                        raise
                    except Exception as exc:  # CUDARuntimeError: stale, foreign or own handle
                        raise RegistryError("bad_request", f"region {i}: cannot open its CUDA "
                                            f"IPC handle on {layout.device}: {exc}") from None
                    reg._ipc_handles.append(handle)
                    if size > mapping.mapped_bytes:
                        raise RegistryError("bad_request", f"region {i}: size_bytes {size} "
                                            "exceeds the CUDA allocation behind its IPC handle "
                                            f"({mapping.mapped_bytes} bytes)")
                    mapped[handle] = mapping.ptr
                reg._region_ptrs.append(mapped[handle])
            ptrs = [p + _CORRUPT_OFFSET for p in reg._region_ptrs] if corrupt else \
                reg._region_ptrs
            reg._pipeline = CopyPipeline(reg.copier, PieceTable(layout, ptrs))
        except BaseException:
            reg.unmap()
            raise
        return reg

    def device_ptrs(self, block_ids: np.ndarray, device_id: int | None = None) -> np.ndarray:
        """int64 ``[len(block_ids), regions]``: the address of each block's region pieces, as
        a copy on ``device_id`` (None: this registration's own device) reads them."""
        bases = self._region_ptrs if device_id in (None, self.device_id) else \
            self._peer_bases(device_id)
        regions = self.layout.regions
        base = np.array([b + r.offset for b, r in zip(bases, regions)], dtype=np.int64)
        stride = np.array([r.block_stride for r in regions], dtype=np.int64)
        return base + np.asarray(block_ids, dtype=np.int64).reshape(-1, 1) * stride

    def _peer_bases(self, device_id: int) -> list[int]:
        """The regions' bases opened from their IPC handles with ``device_id`` current (once,
        kept until unmapped). Measured on H200s joined by NVLink: the mapping opened on the
        engine's own device is no peer memory for another device (a kernel there reads an
        illegal address, even with peer access enabled; a copy is staged through the host at
        27 GB/s), while one opened on the reading device copies at 242 GB/s. Call inside
        ``open_for_copy``; RuntimeError if the handle cannot be opened there."""
        with self._peer_lock:
            bases = self._peer_ptrs.get(device_id)
            if bases is not None:
                return bases
            mapped: dict[bytes, int] = {}
            bases = []
            for i, region in enumerate(self.layout.regions):
                handle = region.handle
                if handle not in mapped:
                    size = max(r.size_bytes for r in self.layout.regions if r.handle == handle)
                    mapping = self._ipc_table.acquire(handle, size, device_id,
                                                      f"region {i} on device {device_id}")
                    self._peer_handles.append((handle, device_id))
                    mapped[handle] = mapping.ptr
                bases.append(mapped[handle])
            self._peer_ptrs[device_id] = bases
            return bases

    @property
    def pipeline(self) -> CopyPipeline:
        """The mapped regions' copy pipeline; RegistryError once unmapped."""
        pipeline = self._pipeline
        if pipeline is None:
            raise RegistryError("not_found", f"registration {self.registration_id} is unmapped")
        return pipeline

    def read_block(self, block_id: int, out: memoryview) -> None:
        self.pipeline.copy_blocks([block_id], [host_address(out)], to_device=False).wait()

    def write_block(self, block_id: int, data: memoryview) -> None:
        self.pipeline.copy_blocks([block_id], [host_address(data)], to_device=True).wait()

    def save_blocks(self, store: BlockStore, namespace: bytes, block_ids: Sequence[int],
                    hashes: Sequence[bytes], idents: Sequence[bytes],
                    cancel: Cancellation, outcomes: list[str]) -> None:
        outcomes += self.pipeline.save(store, namespace, block_ids, hashes, idents,
                                       lambda: cancel.cancelled)

    def load_blocks(self, store: BlockStore, lease: Lease, first_index: int,
                    block_ids: Sequence[int], cancel: Cancellation) -> int:
        return self.pipeline.load(store, lease, block_ids, lambda: cancel.cancelled,
                                  first_index=first_index)

    def _unmap_memory(self) -> None:
        self._pipeline = None
        self._region_ptrs.clear()
        while self._ipc_handles:
            self._ipc_table.release(self._ipc_handles.pop(), self.device_id)
        with self._peer_lock:
            self._peer_ptrs.clear()
            while self._peer_handles:
                self._ipc_table.release(*self._peer_handles.pop())

