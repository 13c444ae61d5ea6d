"""A CPU engine's registration: its KV regions in shared memory it sent by file descriptor.

A registration proves possession: each CPU region names one of the file descriptors the engine
sent with its register frame (``SCM_RIGHTS``), an anonymous ``memfd`` no other process can open by
name; a region that names shared memory by name is refused. The daemon maps the descriptors it
received on that very connection. Sizes are checked against the memory itself, never taken on the
engine's word, and the memory must be sealed against shrinking (``F_SEAL_SHRINK``): an engine can
then never cut its memory short under a running copy (which would kill the daemon with SIGBUS).

Saves and loads go block by block. A save reserves a store slot per block, copies the engine's
block into it and publishes it only after the copy; a load reads each leased block (promoting
SSD ones), copies it into the engine's block, then hands it back (``done``) so a lease larger
than DRAM is promoted piece by piece. The request's cancellation is checked between blocks: a
cancelled call stops writing at the next block boundary.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
from collections.abc import Sequence

from kvstore.engines.registration import Cancellation, Registration, RegistryError
from kvstore.layout import KVLayout
from kvstore.store.block_store import BlockStore, Lease, StoreError

# Why a name is not enough, said to a client that still registers by name.
BY_NAME_REFUSED = ("registrations by shared-memory name are refused: any process of this uid "
                   "could name another engine's memory. Send the memory's file descriptor with "
                   "the register frame instead (an anonymous memfd, SCM_RIGHTS; "
                   "kvstore.Client.register sends KVLayout.fds)")


def fd_of(handle: object, fds: Sequence[int], what: str) -> int:
    """The received descriptor ``handle`` indexes; RegistryError if it names memory otherwise
    (a shared-memory name: permission_denied) or past the descriptors the frame carried."""
    if isinstance(handle, str):
        raise RegistryError("permission_denied", f"{what} names shared memory {handle[:64]!r}: "
                            + BY_NAME_REFUSED)
    if type(handle) is not int:
        raise RegistryError("bad_request", f"{what}: a CPU handle must be the index of a file "
                            f"descriptor sent with the register frame, got "
                            f"{type(handle).__name__}")
    if not 0 <= handle < len(fds):
        raise RegistryError("bad_request", f"{what} names file descriptor {handle}; the register "
                            f"frame carried {len(fds)}")
    return fds[handle]


def map_fd(fd: int, writable: bool, what: str) -> mmap.mmap:
    """Map the whole of received descriptor ``fd``; RegistryError unless it is shared memory
    (a regular file, not empty) sealed against shrinking, mappable as asked."""
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS) if stat.S_ISREG(st.st_mode) else 0
    except OSError as exc:  # EINVAL: a file that takes no seals (not a memfd)
        raise RegistryError("bad_request", f"{what}: its file descriptor is not sealable shared "
                            f"memory (memfd_create with MFD_ALLOW_SEALING): {exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise RegistryError("bad_request", f"{what}: its file descriptor is not shared memory")
    if not seals & fcntl.F_SEAL_SHRINK:
        raise RegistryError("bad_request", f"{what}: its memory must be sealed against shrinking "
                            "(fcntl F_ADD_SEALS F_SEAL_SHRINK) before it is registered")
    if st.st_size == 0:
        raise RegistryError("bad_request", f"{what}: its memory is empty")
    prot = mmap.PROT_READ | mmap.PROT_WRITE if writable else mmap.PROT_READ
    try:
        return mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, prot)
    except OSError as exc:  # EACCES: a descriptor opened read-only, for memory to be written
        raise RegistryError("bad_request", f"{what}: cannot map its memory"
                            f"{' for writing' if writable else ''}: {exc}") from None


class ShmRegistration(Registration):
    """Regions as views of the received memory (each descriptor mapped once)."""

    def __init__(self, registration_id: int, engine_id: str, layout: KVLayout,
                 owner: str) -> None:
        super().__init__(registration_id, engine_id, layout, owner)
        self._maps: dict[int, mmap.mmap] = {}  # by descriptor index
        self._views: list[memoryview] = []  # one per region

    @classmethod
    def open(cls, registration_id: int, engine_id: str, layout: KVLayout, owner: str,
             fds: Sequence[int]) -> ShmRegistration:
        """Map every region's descriptor (from ``fds``, those sent with the register frame);
        RegistryError (nothing left mapped) if one does not fit."""
        reg = cls(registration_id, engine_id, layout, owner)
        try:
            for i, region in enumerate(layout.regions):
                fd = fd_of(region.handle, fds, f"region {i}")
                index = int(region.handle)
                if index not in reg._maps:
                    reg._maps[index] = map_fd(fd, True, f"region {i}")
                mapping = reg._maps[index]
                if region.size_bytes > len(mapping):
                    raise RegistryError("bad_request", f"region {i}: size_bytes "
                                        f"{region.size_bytes} exceeds its memory (file "
                                        f"descriptor {index}) of {len(mapping)} bytes")
                reg._views.append(memoryview(mapping)[:region.size_bytes])
        except BaseException:
            reg.unmap()
            raise
        return reg

    @property
    def num_mappings(self) -> int:
        return len(self._maps) + super().num_mappings

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
