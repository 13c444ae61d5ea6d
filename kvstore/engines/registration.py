"""A registered engine as the daemon sees it: its layout and mapped KV memory, copied by block.

``Registration`` is the contract; ``ShmRegistration`` (CPU, POSIX shared memory) and
``CudaRegistration`` (GPU, CUDA IPC) implement it. Copies hold the registration open, so
unregistering (or the engine's disconnect) while a copy runs unmaps only after the last copy is
done. A registration may name its block generations (a small shared-memory array of uint64
counters the engine bumps whenever it reallocates a block, sent by file descriptor as CPU memory
is): the daemon maps it read-only, and the HBM tier reads it to know a published block is still
what it was.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import numpy as np

from kvstore.layout import GENERATION_DTYPE, KVLayout
from kvstore.store.block_store import BlockStore, Lease


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


class Cancellation(Protocol):
    """Whether the request a copy serves was cancelled (deadline, disconnect)."""

    @property
    def cancelled(self) -> bool: ...

    def check(self) -> None:
        """Raise the request's error if it was cancelled."""


def host_address(buffer: memoryview) -> int:
    """The address of a (read-only or writable) host buffer's first byte."""
    return np.frombuffer(buffer, dtype=np.uint8).__array_interface__["data"][0]


class Registration(ABC):
    """One engine's layout and mappings. Copies run inside ``open_for_copy``; ``close`` marks
    it closed and the memory is unmapped once the last copy is done."""

    is_cuda = False  # CUDA registrations copy through a device copier, CPU ones by memcpy

    def __init__(self, registration_id: int, engine_id: str, layout: KVLayout,
                 owner: str) -> None:
        self.registration_id = registration_id
        self.engine_id = engine_id
        self.layout = layout
        self.owner = owner
        self._generation_map: mmap.mmap | None = None  # read-only
        self._generations: np.ndarray | None = None  # uint64[num_blocks]
        self._num_copies = 0
        self._closed = False
        self._unmapped = False
        self._on_unmapped: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    # -- memory, per implementation ---------------------------------------------------------

    @abstractmethod
    def read_block(self, block_id: int, out: memoryview) -> None:
        """Copy engine block ``block_id`` (its region pieces, concatenated) into ``out``."""

    @abstractmethod
    def write_block(self, block_id: int, data: memoryview) -> None:
        """Copy ``data`` (a whole block) into engine block ``block_id``'s region pieces."""

    @abstractmethod
    def save_blocks(self, store: BlockStore, namespace: bytes, block_ids: Sequence[int],
                    hashes: Sequence[bytes], idents: Sequence[bytes],
                    cancel: Cancellation, outcomes: list[str]) -> None:
        """Copy engine blocks into new store blocks, each published only after its copy
        finished; appends one outcome per block handled (saved, duplicate, failed) to
        ``outcomes`` (also when it raises midway). Inside ``open_for_copy``."""

    @abstractmethod
    def load_blocks(self, store: BlockStore, lease: Lease, first_index: int,
                    block_ids: Sequence[int], cancel: Cancellation) -> int:
        """Copy the lease's blocks ``first_index, ...`` into ``block_ids``; how many, from
        the first, fully arrived (fail closed). Inside ``open_for_copy``."""

    @abstractmethod
    def _unmap_memory(self) -> None:
        """Release the mapped KV memory (called once no copy holds it)."""

    # -- shared behaviour --------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def num_mappings(self) -> int:
        """Host memory mapped from the engine's file descriptors (each holds one descriptor)."""
        return int(self._generation_map is not None)

    @property
    def has_generations(self) -> bool:
        """The engine shares its block generations: its blocks may be served as the HBM tier."""
        return self._generations is not None

    def attach_generations(self, mapping: mmap.mmap) -> None:
        """Read block generations from ``mapping`` (read-only, ``num_blocks`` uint64s at least);
        the registration owns it from now on."""
        self._generation_map = mapping
        self._generations = np.frombuffer(mapping, dtype=GENERATION_DTYPE,
                                          count=self.layout.num_blocks)

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
                self.unmap()

    def close(self) -> None:
        """Mark closed; the mappings go once no copy holds them. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            unmap = self._num_copies == 0
        if unmap:
            self.unmap()

    def when_unmapped(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the mappings are gone (at once if they are already): the
        registry gives the memory's claims back then, not at ``close``, so a registration of
        the same memory accepted later means no copy of this one still reads or writes it."""
        with self._lock:
            if not self._unmapped:
                self._on_unmapped.append(callback)
                return
        callback()

    def unmap(self) -> None:
        """Release every mapping now (also for a registration that failed to open)."""
        generation_map, self._generation_map = self._generation_map, None
        self._generations = None
        if generation_map is not None:
            # BufferError: a reader still holds the array (it saw the registration open a moment
            # ago); the mapping then goes with that array.
            with contextlib.suppress(BufferError):
                generation_map.close()
        try:
            self._unmap_memory()
        finally:
            with self._lock:
                self._unmapped = True
                callbacks, self._on_unmapped = self._on_unmapped, []
            for callback in callbacks:
                callback()
