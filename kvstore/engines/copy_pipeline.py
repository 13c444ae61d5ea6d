"""One CUDA registration's copy pipeline: its whole blocks moved as pipelined batches.

The registration owns it (built once its regions are mapped) and hands it its saves and loads.
A save reserves store slots, copies engine HBM into them (device to host) and publishes each block
only after the copy that filled it completed; a load reads the leased blocks (promoting SSD ones)
and copies them into the engine's blocks (host to device). Both cut the request into chunks: a
save's of at most the copier's ``settings.chunk_bytes``, growing from two blocks by doubling; a
load's of at most ``settings.load_chunk_bytes``, growing from ``settings.load_growth`` blocks by
that factor. While one chunk copies on the copier's streams, the next is prepared (a save's
slots reserved: a few us of Python per block, a tenth of the copy time of a 2.36 MB block; a
load's addresses read in one store call), so the copy engine never waits for the whole batch to
be reserved first, and a load, whose next chunk costs only its submission, goes in few chunks.
A chunk goes to the copier as block ids and host addresses (``copy_blocks``): it packs a
layout's pieces on the GPU from a table of block ids, or builds the chunk's runs in one go from
the piece table, never a Python object per piece. A chunk size of 0 makes each request one
submission. A save keeps at most ``MAX_UNPUBLISHED_BYTES`` reserved but unpublished, and when
the pool is full it publishes what it has copied before giving up on a block, so a batch larger
than free DRAM still goes through.

Invariants: a slot's bytes become visible only after its chunk's event completed; no copy is still
in flight when a method returns or raises (aborted slots and released leases are never touched
by DMA afterwards); ``load`` counts only the leading blocks whose copies completed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvstore.engines.copier import CopyHandle, CudaCopier
from kvstore.engines.copy_bounds import HostSpans
from kvstore.engines.copy_timing import CallClock, CopyWay
from kvstore.engines.registration import host_address
from kvstore.engines.run_arrays import PieceTable
from kvstore.store.block_store import BlockStore, Lease, StoreError, WriteSlot

log = logging.getLogger(__name__)

# A save waits for its oldest copies once this much is reserved but unpublished: enough to keep
# the copy engine busy (~5 ms at 55 GB/s) without filling the pool with invisible blocks.
MAX_UNPUBLISHED_BYTES = 256 << 20
_SAVE_GROWTH = 2  # a save's chunks: 2, 4, 8 ... blocks (each reserves a slot per block)


@dataclass(eq=False)
class _Chunk:
    """One submission: the slots it fills (save) or the blocks it carries (load)."""

    handle: CopyHandle | None = None
    slots: list[tuple[int, WriteSlot]] = field(default_factory=list)  # save: (index, slot)
    start: int = 0  # load: the chunk carries request indices start .. start + num_blocks - 1
    num_blocks: int = 0


def chunk_spans(num_items: int, block_bytes: int, chunk_bytes: int,
                growth: int = _SAVE_GROWTH) -> Iterator[range]:
    """Request indices ``0 .. num_items - 1`` in chunks of ``growth`` blocks, growing by that
    factor up to ``chunk_bytes`` of blocks each (one chunk of all where ``chunk_bytes`` <= 0)."""
    if chunk_bytes <= 0:
        yield range(num_items)
        return
    most = max(1, chunk_bytes // max(1, block_bytes))
    size, start = min(growth, most), 0
    while start < num_items:
        yield range(start, min(num_items, start + size))
        start += size
        size = min(most, size * growth)


def _finished(chunk: _Chunk, block: bool) -> bool | None:
    """True: the chunk's copies completed; False: a copy failed; None: still running."""
    if chunk.handle is None:
        return True
    try:
        if block:
            chunk.handle.wait()
            return True
        return True if chunk.handle.poll() else None
    except Exception as exc:  # a CUDA error surfaces at the event
        log.error("a batch of %d block copies failed: %s", chunk.num_blocks, exc)
        return False


def _drain(chunks: Sequence[_Chunk]) -> None:
    """Wait until no copy of ``chunks`` runs any more, whatever their outcome."""
    for chunk in chunks:
        if chunk.handle is not None:
            with contextlib.suppress(Exception):
                chunk.handle.wait()


def _publish_done(pending: deque[_Chunk], outcomes: list[str], num_bytes: int,
                  max_unpublished_bytes: int, clock: CallClock) -> bool:
    """Publish the leading chunks whose copies completed, waiting for them while more than
    ``max_unpublished_bytes`` are pending (0: wait for all). True when a copy failed: that chunk
    and the ones after it stay pending, to be aborted."""
    while pending:
        num_unpublished = sum(c.num_blocks for c in pending) * num_bytes
        done = _finished(pending[0], block=num_unpublished > max_unpublished_bytes)
        if done is None:
            return False
        if not done:
            return True
        for i, slot in pending.popleft().slots:
            outcomes[i] = "saved" if clock.store_verb(slot.commit) else "duplicate"
    return False


class CopyPipeline:
    """A registration's whole blocks between its device memory (``table``, over the mapped
    regions) and host addresses, through the device's copier; thread-safe (the copier locks
    its streams). Use it inside the registration's ``open_for_copy``."""

    def __init__(self, copier: CudaCopier, table: PieceTable) -> None:
        self.copier = copier
        self.table = table
        self.settings = copier.settings

    @property
    def block_bytes(self) -> int:
        return self.table.block_bytes

    def copy_blocks(self, block_ids: Sequence[int], host_addrs: Sequence[int],
                    to_device: bool) -> CopyHandle:
        """Submit whole blocks between the engine and the ``block_bytes`` at each
        ``host_addrs[i]`` (``to_device``: a load); the copier packs them where it can."""
        if to_device:
            return self.copier.blocks_to_device(self.table, block_ids, host_addrs)
        return self.copier.blocks_to_host(self.table, block_ids, host_addrs)

    def _copy_checked(self, spans: HostSpans, block_ids: Sequence[int],
                      host_addrs: Sequence[int], to_device: bool) -> CopyHandle:
        """``copy_blocks`` once every host block lies inside one of the store's spans
        (CopyOutOfBounds otherwise, nothing submitted)."""
        spans.check(host_addrs, self.block_bytes)
        return self.copy_blocks(block_ids, host_addrs, to_device)

    def save(self, store: BlockStore, namespace: bytes, block_ids: Sequence[int],
             hashes: Sequence[bytes], idents: Sequence[bytes],
             stopped: Callable[[], bool]) -> list[str]:
        """Copy engine blocks into the store; one outcome per block: saved, duplicate or failed.

        A failed copy aborts every slot not yet published (reported failed); chunks published
        before it stay saved: their copies had completed. Once ``stopped()`` (deadline, disconnect)
        no chunk is started; the copies in flight finish and are published, the rest is failed.
        Call inside ``open_for_copy``.
        """
        num_bytes = self.block_bytes
        clock = CallClock()
        spans = HostSpans(store.host_spans())
        outcomes: list[str] = ["failed"] * len(block_ids)
        pending: deque[_Chunk] = deque()  # submitted, not yet published, oldest first
        try:
            for span in chunk_spans(len(block_ids), num_bytes, self.settings.chunk_bytes):
                if stopped():
                    break
                chunk, ids, addrs = _Chunk(), [], []
                for i in span:
                    write = (store.begin_write, namespace, hashes[i], idents[i], num_bytes)
                    try:
                        slot = clock.store_verb(*write)
                    except StoreError:
                        # The pool may be full of this request's own unpublished blocks: publish
                        # them (they become evictable or demotable) and try once more.
                        if not pending or _publish_done(pending, outcomes, num_bytes, 0, clock):
                            continue  # stays "failed"
                        try:
                            slot = clock.store_verb(*write)
                        except StoreError:
                            continue  # stays "failed": the pool is full of pinned blocks
                    if slot is None:
                        outcomes[i] = "duplicate"
                        continue
                    chunk.slots.append((i, slot))
                    ids.append(block_ids[i])
                    addrs.append(slot.address)
                chunk.num_blocks = len(chunk.slots)
                pending.append(chunk)
                if ids:
                    began_at = time.perf_counter()
                    try:
                        chunk.handle = self._copy_checked(spans, ids, addrs, to_device=False)
                    except Exception as exc:  # the copier has waited out what it had enqueued
                        log.error("submitting %d block copies failed: %s", chunk.num_blocks, exc)
                        return outcomes
                    finally:
                        clock.submitted(began_at)
                if _publish_done(pending, outcomes, num_bytes, MAX_UNPUBLISHED_BYTES, clock):
                    return outcomes
            _publish_done(pending, outcomes, num_bytes, 0, clock)
            return outcomes
        finally:
            _drain(pending)
            for chunk in pending:  # unpublished: a copy failed or the call was stopped
                for _, slot in chunk.slots:
                    slot.abort()
            clock.report(self.copier.timing, CopyWay.SAVE)

    def load(self, store: BlockStore, lease: Lease, block_ids: Sequence[int],
             stopped: Callable[[], bool], first_index: int = 0) -> int:
        """Copy the lease's blocks ``first_index .. first_index + len(block_ids) - 1`` into engine
        blocks; returns how many of them, from the first, are known to have arrived (fail closed: a
        failed copy ends the count).

        Stops at the first block the store cannot produce, and starts no chunk once ``stopped()``.
        A block whose copy completed is handed back (``store.done``), so a lease larger than DRAM
        can be promoted from SSD piece by piece. Call inside ``open_for_copy`` with the lease held;
        returns only once no copy is in flight.
        """
        num_bytes = self.block_bytes
        clock = CallClock()
        spans = HostSpans(store.host_spans())
        pending: deque[_Chunk] = deque()  # submitted, oldest first (counted in this order)
        num_loaded, failed = 0, False

        def retire(block: bool) -> bool:
            """Count the leading chunks whose copies completed; False once one failed."""
            nonlocal num_loaded, failed
            while pending and not failed:
                ok = _finished(pending[0], block)
                if ok is None:
                    return True
                if not ok:
                    failed = True  # this chunk and the ones after it count for nothing
                    break
                chunk = pending.popleft()
                clock.store_verb(store.done_range, lease, first_index + chunk.start,
                                 chunk.num_blocks)
                num_loaded += chunk.num_blocks
            return not failed

        def read_one(i: int) -> int | None:
            """Block ``i``'s address the slow way (``read``: an SSD promotion, an error), or
            None where the load stops."""
            try:
                data = clock.store_verb(store.read, lease, first_index + i)
            except StoreError:  # BlockUnavailable included: the hit shrinks here
                # DRAM may be full of this load's pinned blocks: let the copies out of them
                # finish, hand them back, and ask once more.
                if not pending or not retire(block=True):
                    return None
                try:
                    data = clock.store_verb(store.read, lease, first_index + i)
                except StoreError:
                    return None
            if data.nbytes != num_bytes:
                return None  # stored under another layout; never copy a partial block
            return host_address(data)

        try:
            stop = False
            for span in chunk_spans(len(block_ids), num_bytes, self.settings.load_chunk_bytes,
                                    self.settings.load_growth):
                if stopped():
                    break
                try:
                    addrs = clock.store_verb(store.read_addresses, lease,
                                             first_index + span.start, len(span), num_bytes)
                except StoreError:  # released or expired: ``read`` says so, block by block
                    addrs = []
                for i in span[len(addrs):]:  # the batch stopped at a block not simply in DRAM
                    addr = read_one(i)
                    if addr is None:
                        stop = True
                        break
                    addrs.append(addr)
                chunk = _Chunk(start=span.start, num_blocks=len(addrs))
                ids = block_ids[span.start:span.start + len(addrs)]
                if addrs:
                    began_at = time.perf_counter()
                    try:
                        chunk.handle = self._copy_checked(spans, ids, addrs, to_device=True)
                    except Exception as exc:  # nothing of this chunk is in flight any more
                        log.error("submitting %d block copies failed: %s", chunk.num_blocks, exc)
                        break
                    finally:
                        clock.submitted(began_at)
                    pending.append(chunk)
                if stop or not retire(block=False):
                    break
            retire(block=True)
            return num_loaded
        finally:
            _drain(pending)
            clock.report(self.copier.timing, CopyWay.LOAD)
