"""The in-process block store contract: what the daemon's verbs call, whatever the tiers are.

A block is addressed by (namespace digest, block hash), both 16 bytes, and carries an ``ident``: the
bytes that prove a hit is the block asked for (parent hash + token ids for KV blocks, the full user
key for the bytes API). A hit whose stored ident differs is a miss (counted as a collision), never
data. Thread-safe: the daemon calls it from its event loop and from worker threads.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from kvstore.tiers import Tier

# Told (namespace, block hashes) of blocks that no tier holds any more.
DropListener = Callable[[bytes, list[bytes]], None]


class StoreError(Exception):
    """A request the store cannot honour (bad argument, value larger than the pool...)."""


class BlockUnavailable(StoreError):
    """A leased block could not be produced (damaged on SSD, lost): the hit shrinks before it."""


@dataclass
class Lease:
    """Pins a run of blocks against eviction until released or expired; use as a context manager.

    Only the store creates leases. ``released`` flips once; releasing twice is harmless.
    """

    lease_id: int
    namespace: bytes
    block_hashes: list[bytes]
    tiers: list[Tier]
    expires_at: float
    owner: str = ""
    released: bool = False
    store: BlockStore | None = field(default=None, repr=False)  # the store that granted it
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def expired(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.expires_at

    def release(self) -> None:
        if self.store is not None:
            self.store.release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class LookupResult:
    """The verified prefix: ``num_hit`` blocks from the start, the tier of each, and their lease."""

    num_hit: int
    tiers: list[Tier]
    lease: Lease | None


class WriteSlot(ABC):
    """A reserved, not yet visible block: fill ``buffer``, then ``commit()`` or ``abort()``.

    Until commit the block is in flight: no lookup sees it and eviction never touches it.
    """

    buffer: memoryview
    address: int  # the host address of ``buffer``'s first byte (for a device copy into it)

    @abstractmethod
    def commit(self) -> bool:
        """Publish the block; False when an equal block was published meanwhile (idempotent)."""

    @abstractmethod
    def abort(self) -> None:
        """Drop the reservation; the bytes never become visible."""


class BlockStore(ABC):
    """Tiered storage of blocks with verified hits, leases and counted outcomes."""

    @abstractmethod
    def lookup(self, namespace: bytes, block_hashes: Sequence[bytes], idents: Sequence[bytes],
               lease_ttl_s: float | None = 30.0, owner: str = "") -> LookupResult:
        """Longest verified prefix of ``block_hashes``; stops at the first miss or ident mismatch.

        With ``lease_ttl_s`` and a non-empty hit, the hit blocks are pinned by the returned lease.
        """

    @abstractmethod
    def probe(self, namespace: bytes, block_hashes: Sequence[bytes],
              idents: Sequence[bytes]) -> list[Tier]:
        """The tier of each block of the longest verified prefix ``lookup`` would find, without
        pinning, promoting, counting or touching anything (eviction order unchanged)."""

    @abstractmethod
    def read(self, lease: Lease, index: int) -> memoryview:
        """The bytes of the lease's block ``index`` in DRAM, promoting it from SSD first if needed.

        Valid while the lease is held. Raises BlockUnavailable if the block turned out damaged
        (it is then dropped from the store) and StoreError if the lease was released or expired.
        """

    @abstractmethod
    def read_addresses(self, lease: Lease, start: int, count: int, num_bytes: int) -> list[int]:
        """Host addresses of the lease's blocks ``start`` .. ``start + count - 1`` that are in
        DRAM and ``num_bytes`` long, from the first: the list stops before the first block that is
        not (one on SSD, one already done, one of another size), which ``read`` then produces or
        explains. One lock for the whole range: a device copy's batch, not a Python view per
        block. Each address is valid as long as ``read``'s view would be. StoreError if the lease
        was released or expired, or the range is not the lease's."""

    @abstractmethod
    def done(self, lease: Lease, index: int) -> None:
        """The reader has copied block ``index`` of the lease out: its pin goes now, not at release.

        Lets a lease cover more SSD blocks than DRAM holds: each block read promotes it into
        DRAM, and ``done`` after its copy lets the next promotion reuse that room. Call it only
        once every copy out of ``read``'s view has finished (an async copy: after it completed);
        the view is invalid from then on and a later ``read`` of ``index`` raises StoreError.
        The other blocks stay pinned until they are done, or the lease is released or expires.
        Idempotent; a no-op on a released lease.
        """

    @abstractmethod
    def done_range(self, lease: Lease, start: int, count: int) -> None:
        """``done`` for blocks ``start`` .. ``start + count - 1`` of the lease, under one lock."""

    @abstractmethod
    def begin_write(self, namespace: bytes, block_hash: bytes, ident: bytes,
                    num_bytes: int) -> WriteSlot | None:
        """Reserve DRAM for a new block (evicting or demoting unpinned blocks if needed).

        None when the block is already stored with the same ident (a put is idempotent). Raises
        StoreError when ``num_bytes`` can never fit or every byte of the pool is pinned.
        """

    @abstractmethod
    def replace(self, namespace: bytes, block_hash: bytes, ident: bytes,
                data: bytes | memoryview, wait_s: float = 5.0) -> bool:
        """Store a copy of ``data``, replacing any block under the same key in every tier.

        A reader sees the old block or the new one, never a mix. True when an older block was
        replaced; StoreError when the old one stays pinned by a reader for ``wait_s``.
        """

    @abstractmethod
    def holding(self, namespace: bytes, block_hashes: Sequence[bytes]) -> list[bool]:
        """Per hash, whether a tier holds a block under it (being written counts; any ident):
        nothing pinned, touched or counted. For deciding whether a block left this node."""

    @abstractmethod
    def held_hashes(self) -> list[bytes]:
        """The block hash of every block a tier holds or is writing, as of the call, in no
        order (a hash held under several namespaces may repeat): what the key filter is
        rebuilt from."""

    @abstractmethod
    def remove(self, namespace: bytes, block_hash: bytes) -> bool:
        """Drop a block from every tier unless pinned; True if something was dropped."""

    @abstractmethod
    def release(self, lease: Lease) -> None:
        """Unpin a lease's blocks. Idempotent. While the lease is ``reading``, its reads fail
        from now on and the pins go when the reading ends."""

    @abstractmethod
    def reading(self, lease: Lease) -> AbstractContextManager[None]:
        """A copy reads ``lease``'s blocks inside (``read``, the copy, ``done``): the lease
        neither expires nor lets go of a block until the end, so no write reuses memory a copy
        in flight still reads. A read past the lease's deadline still raises StoreError."""

    @abstractmethod
    def expire_leases(self, now: float | None = None) -> int:
        """Release every lease past its deadline; returns how many."""

    @abstractmethod
    def flush_to_ssd(self) -> int:
        """Write every DRAM block that the SSD lacks to SSD, keeping the DRAM copies; returns
        how many were written (0 without an SSD). For graceful shutdown, tests and tools:
        afterwards a restart from the same SSD directory serves every block that was ready."""

    @abstractmethod
    def add_drop_listener(self, listener: DropListener) -> None:
        """From now on tell ``listener(namespace, block_hashes)`` of blocks that left every
        tier (evicted, dropped as damaged, removed; a demotion is no drop), in batches, on the
        thread that dropped them, never with the store's lock held. A block stored again by
        then is not reported. A listener's failure is logged, never raised."""

    @abstractmethod
    def remove_drop_listener(self, listener: DropListener) -> None:
        """Stop telling ``listener`` (harmless if it was not listening)."""

    @abstractmethod
    def stats(self) -> dict:
        """``tiers.{dram,ssd}.{capacity_bytes,used_bytes,blocks}`` plus counted outcomes."""

    @abstractmethod
    def host_spans(self) -> list[tuple[int, int]]:
        """(start, end) addresses of the host memory that ``read`` and ``begin_write`` buffers
        lie in, one range per span a single device copy may cover (a pinned registration)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError if accounting is off (free + used + in-flight != capacity...)."""

    @abstractmethod
    def close(self) -> None:
        """Stop background work and flush what must survive a restart."""

    def put(self, namespace: bytes, block_hash: bytes, ident: bytes,
            data: bytes | memoryview) -> bool:
        """Store a copy of ``data``; False if an equal block was already there."""
        view = memoryview(data).cast("B")
        slot = self.begin_write(namespace, block_hash, ident, view.nbytes)
        if slot is None:
            return False
        try:
            slot.buffer[:] = view
        except BaseException:
            slot.abort()
            raise
        return slot.commit()

    def get(self, namespace: bytes, block_hash: bytes, ident: bytes) -> bytes | None:
        """A copy of the block's bytes from whichever tier holds it, or None."""
        result = self.lookup(namespace, [block_hash], [ident], lease_ttl_s=60.0)
        if result.lease is None:
            return None
        with result.lease as lease:
            try:
                return bytes(self.read(lease, 0))
            except BlockUnavailable:
                return None
