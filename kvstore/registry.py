"""Registered engines: each one's KV layout and its mapped memory, with block-piece copies.

A registration maps every distinct region buffer once (POSIX shared memory on CPU) and checks that
every block id's piece lies inside its mapping. Copies hold the registration open, so unregistering
(or the engine's disconnect) while a copy runs unmaps only after the last copy is done.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import stat
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvstore.layout import KVLayout

# POSIX shm names as multiprocessing.shared_memory makes them; no path separators, no dot-files.
_SHM_NAME = re.compile(r"^/?[A-Za-z0-9_][A-Za-z0-9_.\-]{0,250}$")
_SHM_DIR = "/dev/shm"


class RegistryError(Exception):
    """A layout the daemon cannot map or a block id outside it; ``code`` is a protocol code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class RegistrationClosed(RegistryError):
    def __init__(self, registration_id: int) -> None:
        super().__init__("not_found", f"registration {registration_id} is closed")


def _map_shm(name: str) -> mmap.mmap:
    # Mapped through /dev/shm directly: multiprocessing.SharedMemory (3.11) would register the
    # segment with this process's resource tracker and unlink the engine's memory at our exit.
    if not isinstance(name, str) or not _SHM_NAME.match(name):
        raise RegistryError("bad_request", f"invalid shared-memory name {name!r}")
    path = os.path.join(_SHM_DIR, name.lstrip("/"))
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
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
        return mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


@dataclass
class Registration:
    """One engine's layout and mappings; ``piece_views`` are only valid inside ``open_for_copy``."""

    registration_id: int
    engine_id: str
    layout: KVLayout
    owner: str
    _maps: dict[str, mmap.mmap] = field(default_factory=dict, repr=False)
    _views: list[memoryview] = field(default_factory=list, repr=False)  # one per region
    _num_copies: int = 0
    _closed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    def check_block_ids(self, block_ids: Sequence[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.layout.num_blocks]
        if bad:
            raise RegistryError("bad_request", f"block ids {bad[:8]} out of range "
                                f"0..{self.layout.num_blocks - 1}")

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
        pos = 0
        for region, view in zip(self.layout.regions, self._views):
            start, end = region.piece_bounds(block_id)
            out[pos:pos + region.block_bytes] = view[start:end]
            pos += region.block_bytes

    def write_block(self, block_id: int, data: memoryview) -> None:
        """Copy ``data`` (a whole block) into engine block ``block_id``'s region pieces."""
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
        for view in self._views:
            view.release()
        self._views.clear()
        for mapping in self._maps.values():
            mapping.close()
        self._maps.clear()


class Registry:
    """Registrations by id; thread-safe. Owners are connection names, so a disconnect drops all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[int, Registration] = {}
        self._ids = itertools.count(1)

    def register(self, layout_wire: dict, engine_id: str, owner: str) -> Registration:
        """Map a layout's memory; RegistryError(bad_request|unsupported|not_found) if impossible."""
        try:
            layout = KVLayout.from_wire(layout_wire)
        except (ValueError, TypeError) as exc:
            raise RegistryError("bad_request", f"invalid layout: {exc}") from None
        if layout.device != "cpu":
            if layout.device.startswith("cuda"):
                raise RegistryError("unsupported", f"device {layout.device!r}: CUDA IPC regions "
                                    "are not supported by this daemon yet; register a CPU "
                                    "shared-memory layout")
            raise RegistryError("bad_request", f"unknown device {layout.device!r}")
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
        with self._lock:
            self._by_id[reg.registration_id] = reg
        return reg

    def get(self, registration_id: int, owner: str) -> Registration:
        with self._lock:
            reg = self._by_id.get(registration_id)
        if reg is None or reg.owner != owner:
            raise RegistryError("not_found", f"no registration {registration_id} on this "
                                "connection")
        return reg

    def unregister(self, registration_id: int, owner: str) -> bool:
        with self._lock:
            reg = self._by_id.get(registration_id)
            if reg is None or reg.owner != owner:
                return False
            del self._by_id[registration_id]
        reg.close()
        return True

    def drop_owner(self, owner: str) -> int:
        """Close every registration of ``owner`` (its connection closed); returns how many."""
        with self._lock:
            regs = [r for r in self._by_id.values() if r.owner == owner]
            for reg in regs:
                del self._by_id[reg.registration_id]
        for reg in regs:
            reg.close()
        return len(regs)

    def close_all(self) -> None:
        with self._lock:
            regs = list(self._by_id.values())
            self._by_id.clear()
        for reg in regs:
            reg.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    def describe(self) -> list[dict]:
        with self._lock:
            regs = list(self._by_id.values())
        return [{"registration_id": r.registration_id, "engine_id": r.engine_id,
                 "num_blocks": r.num_blocks, "block_bytes": r.block_bytes, "device":
                 r.layout.device} for r in regs]
