"""Registered engines: each one's KV layout and its mapped memory, with block-piece copies.

A registration maps every distinct region buffer once (POSIX shared memory on CPU, a CUDA IPC
handle on GPU) and checks that every block id's piece lies inside its mapping. Copies hold the
registration open, so unregistering (or the engine's disconnect) while a copy runs unmaps only after
the last copy is done. CUDA registrations copy through their device's ``CudaCopier``
(``block_runs`` gives the runs); CUDA maps a handle at most once per process, so registrations of
the same buffer share one refcounted mapping.

Sizes are checked against the memory itself, never taken on the engine's word: a shared-memory
region against the segment's real size, a CUDA region against the allocation size the driver
reports for the opened IPC mapping. A registration may name its block generations (a small
shared-memory array of uint64 counters the engine bumps whenever it reallocates a block): the
daemon maps it read-only, and the HBM tier reads it to know a published block is still what it
was.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from kvstore.engines import copier as cuda_copier
from kvstore.engines.copier import CopyRun, CudaCopier, CudaIpcMapping
from kvstore.layout import GENERATION_BYTES, GENERATION_DTYPE, KVLayout

log = logging.getLogger(__name__)

# POSIX shm names as multiprocessing.shared_memory makes them; no path separators, no dot-files.
_SHM_NAME = re.compile(r"^/?[A-Za-z0-9_][A-Za-z0-9_.\-]{0,250}$")
_SHM_DIR = "/dev/shm"
_CUDA_DEVICE = re.compile(r"^cuda(?::(\d{1,3}))?$")
CUDA_IPC_HANDLE_BYTES = 64


class RegistryError(Exception):
    """A layout the daemon cannot map or a block id outside it; ``code`` is a protocol code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class RegistrationClosed(RegistryError):
    def __init__(self, registration_id: int) -> None:
        super().__init__("not_found", f"registration {registration_id} is closed")


class BlockIdsOutOfRange(RegistryError):
    """Block ids a request names that the registration does not have; nothing was touched."""

    def __init__(self, bad_ids: Sequence[int], num_blocks: int) -> None:
        super().__init__("bad_request", f"block ids {list(bad_ids)[:8]} out of range "
                         f"0..{num_blocks - 1}")
        self.bad_ids = list(bad_ids)


def _map_shm(name: str, writable: bool = True) -> mmap.mmap:
    # Mapped through /dev/shm directly: multiprocessing.SharedMemory (3.11) would register the
    # segment with this process's resource tracker and unlink the engine's memory at our exit.
    if not isinstance(name, str) or not _SHM_NAME.match(name):
        raise RegistryError("bad_request", f"invalid shared-memory name {name!r}")
    path = os.path.join(_SHM_DIR, name.lstrip("/"))
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW
                     | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RegistryError("not_found", f"shared memory {name!r} does not exist") from None
    except OSError as exc:
        raise RegistryError("bad_request", f"cannot open shared memory {name!r}: {exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise RegistryError("permission_denied",
                                f"shared memory {name!r} is not a segment owned by this user")
        if st.st_size == 0:
            raise RegistryError("bad_request", f"shared memory {name!r} is empty")
        prot = mmap.PROT_READ | mmap.PROT_WRITE if writable else mmap.PROT_READ
        return mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)


def host_address(buffer: memoryview) -> int:
    """The address of a (read-only or writable) host buffer's first byte."""
    return np.frombuffer(buffer, dtype=np.uint8).__array_interface__["data"][0]


class _IpcTable:
    """CUDA IPC mappings open in this process, by (device, handle), with reference counts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[int, bytes], list] = {}  # key -> [mapping, num_users]

    def acquire(self, handle: bytes, size_bytes: int, device_id: int) -> CudaIpcMapping:
        with self._lock:
            entry = self._open.get((device_id, handle))
            if entry is None:
                entry = [CudaIpcMapping(handle, size_bytes, device_id), 0]
                self._open[(device_id, handle)] = entry
            entry[1] += 1
            return entry[0]

    def release(self, handle: bytes, device_id: int) -> None:
        with self._lock:
            entry = self._open[(device_id, handle)]
            entry[1] -= 1
            if entry[1]:
                return
            del self._open[(device_id, handle)]
        try:
            entry[0].close()
        except Exception as exc:  # a broken CUDA context: nothing left to unmap
            log.warning("closing a CUDA IPC mapping on device %d failed: %s", device_id, exc)


def _cuda_device_id(device: str) -> int:
    match = _CUDA_DEVICE.match(device)
    if match is None:
        raise RegistryError("bad_request", f"unknown device {device!r}")
    device_id = int(match.group(1) or 0)
    if not cuda_copier.cuda_available():
        raise RegistryError("unsupported", f"device {device!r}: CUDA IPC regions need a CUDA "
                            "device and this daemon sees none (CuPy missing or no GPU); register "
                            "a CPU shared-memory layout")
    import cupy

    num_devices = cupy.cuda.runtime.getDeviceCount()
    if device_id >= num_devices:
        raise RegistryError("bad_request", f"device {device!r}: this daemon sees "
                            f"{num_devices} CUDA device(s)")
    return device_id


@dataclass
class Registration:
    """One engine's layout and mappings; ``piece_views`` are only valid inside ``open_for_copy``.

    A CUDA registration (``is_cuda``) has ``device_id``, ``copier`` and one device address per
    region instead of views; its device memory stays mapped until ``close`` and the last copy.
    """

    registration_id: int
    engine_id: str
    layout: KVLayout
    owner: str
    _maps: dict[str, mmap.mmap] = field(default_factory=dict, repr=False)
    _views: list[memoryview] = field(default_factory=list, repr=False)  # one per region
    device_id: int | None = None
    copier: CudaCopier | None = field(default=None, repr=False)
    _region_ptrs: list[int] = field(default_factory=list, repr=False)  # CUDA: one per region
    _ipc_handles: list[bytes] = field(default_factory=list, repr=False)  # distinct, acquired
    _ipc_table: _IpcTable | None = field(default=None, repr=False)
    _generation_map: mmap.mmap | None = field(default=None, repr=False)  # read-only
    _generations: np.ndarray | None = field(default=None, repr=False)  # uint64[num_blocks]
    _num_copies: int = 0
    _closed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def is_cuda(self) -> bool:
        return self.device_id is not None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def has_generations(self) -> bool:
        """The engine shares its block generations: its blocks may be served as the HBM tier."""
        return self._generations is not None

    def generation(self, block_id: int) -> int:
        """Block ``block_id``'s generation as the engine last wrote it (a fresh read each call).

        -1 once the registration is closed (no generation equals it).
        """
        gens = self._generations
        if gens is None or self._closed:
            return -1
        return int(gens[block_id])

    def generations_of(self, block_ids: Sequence[int]) -> np.ndarray | None:
        """The generations of many blocks at once (fresh reads); None once closed."""
        gens = self._generations
        if gens is None or self._closed:
            return None
        return gens[np.asarray(block_ids, dtype=np.intp)]

    def piece_views(self, block_id: int) -> list[memoryview]:
        """CPU only: block ``block_id``'s region pieces, in region order (inside
        ``open_for_copy``)."""
        return [view[slice(*region.piece_bounds(block_id))]
                for region, view in zip(self.layout.regions, self._views)]

    def piece_ptrs(self, block_id: int) -> list[int]:
        """CUDA only: the device address of each of block ``block_id``'s region pieces."""
        return [base + region.offset + block_id * region.block_stride
                for region, base in zip(self.layout.regions, self._region_ptrs)]

    def block_runs(self, block_id: int, host_addr: int, to_device: bool) -> list[CopyRun]:
        """CUDA only: the copies moving block ``block_id`` between its device pieces and the
        ``block_bytes`` at ``host_addr`` (pieces concatenated in region order)."""
        runs = []
        for region, base in zip(self.layout.regions, self._region_ptrs):
            dev = base + region.offset + block_id * region.block_stride
            runs.append(CopyRun(host_addr, dev, region.block_bytes) if to_device
                        else CopyRun(dev, host_addr, region.block_bytes))
            host_addr += region.block_bytes
        return runs

    def check_block_ids(self, block_ids: Sequence[int]) -> None:
        """BlockIdsOutOfRange unless every id is a block of this registration."""
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.layout.num_blocks):
            bad = [b for b in block_ids if not 0 <= b < self.layout.num_blocks]
            raise BlockIdsOutOfRange(bad, self.layout.num_blocks)

    @contextmanager
    def open_for_copy(self) -> Iterator[Registration]:
        """Keep the mappings alive for a batch of copies; RegistrationClosed if already closed."""
        with self._lock:
            if self._closed:
                raise RegistrationClosed(self.registration_id)
            self._num_copies += 1
        try:
            yield self
        finally:
            with self._lock:
                self._num_copies -= 1
                unmap = self._closed and self._num_copies == 0
            if unmap:
                self._unmap()

    def read_block(self, block_id: int, out: memoryview) -> None:
        """Copy engine block ``block_id`` (its region pieces, concatenated) into ``out``."""
        if self.is_cuda:
            self.copier.device_to_host(self.block_runs(block_id, host_address(out),
                                                       to_device=False)).wait()
            return
        pos = 0
        for region, view in zip(self.layout.regions, self._views):
            start, end = region.piece_bounds(block_id)
            out[pos:pos + region.block_bytes] = view[start:end]
            pos += region.block_bytes

    def write_block(self, block_id: int, data: memoryview) -> None:
        """Copy ``data`` (a whole block) into engine block ``block_id``'s region pieces."""
        if self.is_cuda:
            self.copier.host_to_device(self.block_runs(block_id, host_address(data),
                                                       to_device=True)).wait()
            return
        pos = 0
        for region, view in zip(self.layout.regions, self._views):
            start, end = region.piece_bounds(block_id)
            view[start:end] = data[pos:pos + region.block_bytes]
            pos += region.block_bytes

    def close(self) -> None:
        """Mark closed; the mappings go once no copy holds them. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            unmap = self._num_copies == 0
        if unmap:
            self._unmap()

    def _unmap(self) -> None:
        generation_map, self._generation_map = self._generation_map, None
        self._generations = None
        if generation_map is not None:
            # BufferError: a reader still holds the array (it saw the registration open a moment
            # ago); the mapping then goes with that array.
            with contextlib.suppress(BufferError):
                generation_map.close()
        for view in self._views:
            view.release()
        self._views.clear()
        for mapping in self._maps.values():
            mapping.close()
        self._maps.clear()
        self._region_ptrs.clear()
        while self._ipc_handles:
            self._ipc_table.release(self._ipc_handles.pop(), self.device_id)


class Registry:
    """Registrations by id; thread-safe. Owners are connection names, so a disconnect drops all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[int, Registration] = {}
        self._ids = itertools.count(1)
        self._ipc = _IpcTable()
        self._copiers: dict[int, CudaCopier] = {}
        # Told of every registration that leaves (unregistered, its connection closed, shutdown),
        # before its mappings go: the HBM tier forgets its blocks.
        self.on_close: Callable[[Registration], None] | None = None

    def register(self, layout_wire: dict, engine_id: str, owner: str) -> Registration:
        """Map a layout's memory; RegistryError(bad_request|unsupported|not_found) if impossible."""
        try:
            layout = KVLayout.from_wire(layout_wire)
        except (ValueError, TypeError) as exc:
            raise RegistryError("bad_request", f"invalid layout: {exc}") from None
        if layout.device != "cpu":
            reg = self._open_cuda(layout, engine_id, owner)
        else:
            reg = self._open_shm(layout, engine_id, owner)
        if layout.generations:
            try:
                self._map_generations(reg)
            except BaseException:
                reg.close()
                raise
        with self._lock:
            self._by_id[reg.registration_id] = reg
        return reg

    @staticmethod
    def _map_generations(reg: Registration) -> None:
        name = reg.layout.generations
        mapping = _map_shm(name, writable=False)
        needed, size = reg.layout.num_blocks * GENERATION_BYTES, len(mapping)
        if size < needed:
            mapping.close()
            raise RegistryError("bad_request", f"block generations {name!r} hold {size} bytes, "
                                f"{reg.layout.num_blocks} blocks need {needed}")
        reg._generation_map = mapping
        reg._generations = np.frombuffer(mapping, dtype=GENERATION_DTYPE,
                                         count=reg.layout.num_blocks)

    def _open_shm(self, layout: KVLayout, engine_id: str, owner: str) -> Registration:
        reg = Registration(next(self._ids), engine_id, layout, owner)
        try:
            for i, region in enumerate(layout.regions):
                name = region.handle
                if isinstance(name, bytes):
                    name = name.decode("utf-8", "replace")
                if name not in reg._maps:
                    reg._maps[name] = _map_shm(name)
                mapping = reg._maps[name]
                if region.size_bytes > len(mapping):
                    raise RegistryError("bad_request", f"region {i}: size_bytes "
                                        f"{region.size_bytes} exceeds shared memory {name!r} of "
                                        f"{len(mapping)} bytes")
                reg._views.append(memoryview(mapping)[:region.size_bytes])
        except BaseException:
            reg._unmap()
            raise
        return reg

    def _open_cuda(self, layout: KVLayout, engine_id: str, owner: str) -> Registration:
        device_id = _cuda_device_id(layout.device)
        handles = []
        for i, region in enumerate(layout.regions):
            if not isinstance(region.handle, bytes) or len(region.handle) != \
                    CUDA_IPC_HANDLE_BYTES:
                raise RegistryError("bad_request", f"region {i}: a CUDA region's handle must be "
                                    f"the {CUDA_IPC_HANDLE_BYTES} bytes of a CUDA IPC handle")
            handles.append(region.handle)
        reg = Registration(next(self._ids), engine_id, layout, owner, device_id=device_id,
                           copier=self._copier(device_id), _ipc_table=self._ipc)
        mapped: dict[bytes, int] = {}
        try:
            for i, handle in enumerate(handles):
                if handle not in mapped:
                    size = max(r.size_bytes for r, h in zip(layout.regions, handles)
                               if h == handle)
                    try:
                        mapping = self._ipc.acquire(handle, size, device_id)
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
        except BaseException:
            reg._unmap()
            raise
        return reg

    def _copier(self, device_id: int) -> CudaCopier:
        with self._lock:
            copier = self._copiers.get(device_id)
            if copier is None:
                copier = self._copiers[device_id] = CudaCopier(device_id)
            return copier

    def get(self, registration_id: int, owner: str) -> Registration:
        with self._lock:
            reg = self._by_id.get(registration_id)
        if reg is None or reg.owner != owner:
            raise RegistryError("not_found", f"no registration {registration_id} on this "
                                "connection")
        return reg

    def of_owner(self, owner: str) -> list[Registration]:
        """The open registrations of one connection."""
        with self._lock:
            return [r for r in self._by_id.values() if r.owner == owner]

    def unregister(self, registration_id: int, owner: str) -> bool:
        with self._lock:
            reg = self._by_id.get(registration_id)
            if reg is None or reg.owner != owner:
                return False
            del self._by_id[registration_id]
        self._close(reg)
        return True

    def drop_owner(self, owner: str) -> int:
        """Close every registration of ``owner`` (its connection closed); returns how many."""
        with self._lock:
            regs = [r for r in self._by_id.values() if r.owner == owner]
            for reg in regs:
                del self._by_id[reg.registration_id]
        for reg in regs:
            self._close(reg)
        return len(regs)

    def close_all(self) -> None:
        with self._lock:
            regs = list(self._by_id.values())
            self._by_id.clear()
        for reg in regs:
            self._close(reg)

    def _close(self, reg: Registration) -> None:
        reg.close()  # first: a copy that checks ``closed`` after this fails its block
        if self.on_close is not None:
            try:
                self.on_close(reg)
            except Exception:  # the registration is gone either way
                log.exception("on_close of registration %d failed", reg.registration_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    def describe(self) -> list[dict]:
        with self._lock:
            regs = list(self._by_id.values())
        return [{"registration_id": r.registration_id, "engine_id": r.engine_id,
                 "num_blocks": r.num_blocks, "block_bytes": r.block_bytes, "device":
                 r.layout.device, "publishes_resident": r.has_generations} for r in regs]
