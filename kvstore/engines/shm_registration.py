"""A CPU engine's registration: its KV regions in POSIX shared memory, copied by memcpy.

Sizes are checked against the memory itself, never taken on the engine's word: each region
against the segment's real size. Segments are mapped through /dev/shm directly, and only
segments owned by this user.

Saves and loads go block by block. A save reserves a store slot per block, copies the engine's
block into it and publishes it only after the copy; a load reads each leased block (promoting
SSD ones), copies it into the engine's block, then hands it back (``done``) so a lease larger
than DRAM is promoted piece by piece. The request's cancellation is checked between blocks: a
cancelled call stops writing at the next block boundary.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
from collections.abc import Sequence

from kvstore.engines.registration import Cancellation, Registration, RegistryError
from kvstore.layout import KVLayout
from kvstore.store.block_store import BlockStore, Lease, StoreError

# POSIX shm names as multiprocessing.shared_memory makes them; no path separators, no dot-files.
_SHM_NAME = re.compile(r"^/?[A-Za-z0-9_][A-Za-z0-9_.\-]{0,250}$")
_SHM_DIR = "/dev/shm"


def map_shm(name: str, writable: bool = True) -> mmap.mmap:
    """Map shared-memory segment ``name``; RegistryError if it is missing, empty or foreign."""
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


class ShmRegistration(Registration):
    """Regions as views of mapped shared-memory segments (each segment mapped once)."""

    def __init__(self, registration_id: int, engine_id: str, layout: KVLayout,
                 owner: str) -> None:
        super().__init__(registration_id, engine_id, layout, owner)
        self._maps: dict[str, mmap.mmap] = {}
        self._views: list[memoryview] = []  # one per region

    @classmethod
    def open(cls, registration_id: int, engine_id: str, layout: KVLayout,
             owner: str) -> ShmRegistration:
        """Map every region's segment; RegistryError (nothing left mapped) if one does not fit."""
        reg = cls(registration_id, engine_id, layout, owner)
        try:
            for i, region in enumerate(layout.regions):
                name = region.handle
                if isinstance(name, bytes):
                    name = name.decode("utf-8", "replace")
                if name not in reg._maps:
                    reg._maps[name] = map_shm(name)
                mapping = reg._maps[name]
                if region.size_bytes > len(mapping):
                    raise RegistryError("bad_request", f"region {i}: size_bytes "
                                        f"{region.size_bytes} exceeds shared memory {name!r} of "
                                        f"{len(mapping)} bytes")
                reg._views.append(memoryview(mapping)[:region.size_bytes])
        except BaseException:
            reg.unmap()
            raise
        return reg

    def piece_views(self, block_id: int) -> list[memoryview]:
        """Block ``block_id``'s region pieces, in region order (inside ``open_for_copy``)."""
        return [view[slice(*region.piece_bounds(block_id))]
                for region, view in zip(self.layout.regions, self._views)]

    def read_block(self, block_id: int, out: memoryview) -> None:
        pos = 0
        for region, view in zip(self.layout.regions, self._views):
            start, end = region.piece_bounds(block_id)
            out[pos:pos + region.block_bytes] = view[start:end]
            pos += region.block_bytes

    def write_block(self, block_id: int, data: memoryview) -> None:
        pos = 0
        for region, view in zip(self.layout.regions, self._views):
            start, end = region.piece_bounds(block_id)
            view[start:end] = data[pos:pos + region.block_bytes]
            pos += region.block_bytes

    def save_blocks(self, store: BlockStore, namespace: bytes, block_ids: Sequence[int],
                    hashes: Sequence[bytes], idents: Sequence[bytes],
                    cancel: Cancellation, outcomes: list[str]) -> None:
        for block_id, block_hash, ident in zip(block_ids, hashes, idents):
            cancel.check()
            outcomes.append(self._save_one(store, namespace, block_id, block_hash, ident))

    def _save_one(self, store: BlockStore, namespace: bytes, block_id: int, block_hash: bytes,
                  ident: bytes) -> str:
        """Saved, duplicate or failed: one block into a new store slot."""
        num_bytes = self.block_bytes
        try:
            slot = store.begin_write(namespace, block_hash, ident, num_bytes)
        except StoreError:
            return "failed"
        if slot is None:
            return "duplicate"
        try:
            self.read_block(block_id, slot.buffer[:num_bytes])
        except BaseException:
            slot.abort()
            raise
        return "saved" if slot.commit() else "duplicate"

    def load_blocks(self, store: BlockStore, lease: Lease, first_index: int,
                    block_ids: Sequence[int], cancel: Cancellation) -> int:
        num_loaded = 0
        for index, block_id in enumerate(block_ids, first_index):
            cancel.check()
            try:
                data = store.read(lease, index)
            except StoreError:  # BlockUnavailable included: the hit shrinks here
                break
            if data.nbytes != self.block_bytes:
                break  # stored under another layout; never copy a partial block
            self.write_block(block_id, data)  # returns once the copy is done
            store.done(lease, index)  # its DRAM may go to the next promotion
            num_loaded += 1
        return num_loaded

    def _unmap_memory(self) -> None:
        for view in self._views:
            view.release()
        self._views.clear()
        for mapping in self._maps.values():
            mapping.close()
        self._maps.clear()
