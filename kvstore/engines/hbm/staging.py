"""PeerStaging: blocks only an engine's arena holds, copied into the store for a peer node.

A peer's fetch reads the store (DRAM); where the store's prefix of the chain falls short, the
blocks that follow may still sit in a registered engine's arena. ``stage`` copies them into the
store, each into a write slot that is committed only if the block's generation is still the
published one after the copy (the seqlock check of an HBM copy, ``copy.py``), so the peer
server then serves them from DRAM. Every block tried ends in one ``BlockOutcome``, counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from kvstore.engines.hbm.index import HbmEntry, HbmIndex
from kvstore.engines.hbm.outcome import BlockOutcome
from kvstore.engines.registration import Registration, RegistrationClosed
from kvstore.store.block_store import BlockStore, StoreError

log = logging.getLogger(__name__)

# Why a stage stopped short, each under its counter.
_FAILURES = {BlockOutcome.GENERATION: "stage_generation_failures",
             BlockOutcome.OWNER_CLOSED: "stage_owner_closed_failures",
             BlockOutcome.STORE_REFUSED: "stage_store_refusals",
             BlockOutcome.COPY_ERROR: "stage_copy_errors"}
# Calls, blocks committed to the store, and the failures, present from the start.
COUNTERS = ("stages", "blocks_staged", *_FAILURES.values())


class PeerStaging:
    """Stages blocks of the index's arenas into the store; thread-safe."""

    def __init__(self, store: BlockStore, index: HbmIndex,
                 report_left: Callable[[], None]) -> None:
        """``report_left``: tells the index's listener of hashes that left it (a stale entry
        a stage dropped); call it outside every lock."""
        self.store = store
        self.index = index
        self._report_left = report_left
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))

    def stage(self, namespace: bytes, hashes: Sequence[bytes], idents: Sequence[bytes],
              start: int, deadline: float,
              after_copy: Callable[[int], None] | None = None) -> int:
        """Copy blocks ``start, start + 1, ...`` of the chain that an engine's arena holds (any
        registration's current, verified entry) into the store, in order, until the first one
        no arena holds, whose copy fails its generation check, or the store refuses, or
        ``deadline`` (monotonic) passes. Returns how many of them the store holds now (staged
        here, or stored meanwhile by someone else). For a peer's fetch: it then reads the store.
        ``after_copy(i)`` (tests) runs once block ``start + i``'s bytes are in its store slot,
        before its generation is checked again.
        """
        if start >= len(hashes) or not self.index.holds(namespace):
            return 0

        def usable(src: Registration) -> bool:
            return src.has_generations and not src.closed

        found = self.index.find(namespace, hashes[start:], idents[start:], usable)
        self._report_left()
        if found is None:
            return 0
        outcomes: Counter[BlockOutcome] = Counter()
        for i, entry in enumerate(found):
            if entry is None or time.monotonic() >= deadline:
                break
            outcome = self._stage_one(entry, namespace, hashes[start + i], idents[start + i],
                                      None if after_copy is None else lambda i=i: after_copy(i))
            outcomes[outcome] += 1
            if outcome in _FAILURES:
                break
        if outcomes[BlockOutcome.GENERATION]:
            self._report_left()  # the stale entry was dropped
        with self._lock:
            self.counters["stages"] += 1
            self.counters["blocks_staged"] += outcomes[BlockOutcome.STAGED]
            for outcome, counter in _FAILURES.items():
                self.counters[counter] += outcomes[outcome]
        return outcomes[BlockOutcome.STAGED] + outcomes[BlockOutcome.STORED]

    def _stage_one(self, entry: HbmEntry, namespace: bytes, block_hash: bytes, ident: bytes,
                   after_copy: Callable[[], None] | None) -> BlockOutcome:
        """One block into the store, committed only if its generation held through the copy."""
        reg = entry.reg
        try:
            slot = self.store.begin_write(namespace, block_hash, ident, reg.block_bytes)
        except StoreError:
            return BlockOutcome.STORE_REFUSED
        if slot is None:
            return BlockOutcome.STORED
        outcome = BlockOutcome.COPY_ERROR
        try:
            with reg.open_for_copy():
                reg.read_block(entry.block_id, slot.buffer[:reg.block_bytes])
            if after_copy is not None:
                after_copy()
            # Seqlock: the generation was the published one when ``find`` picked the entry;
            # unchanged after the copy, nothing can have rewritten the block meanwhile.
            outcome = BlockOutcome.STAGED if entry.current() else BlockOutcome.GENERATION
        except RegistrationClosed:
            outcome = BlockOutcome.OWNER_CLOSED
        except Exception:
            log.exception("staging block %d of registration %d failed", entry.block_id,
                          reg.registration_id)
        finally:
            if outcome is not BlockOutcome.STAGED:
                slot.abort()
        if outcome is BlockOutcome.GENERATION:
            self.index.discard(entry)
        if outcome is not BlockOutcome.STAGED:
            return outcome
        # False only if an equal block was committed meanwhile: stored either way.
        return BlockOutcome.STAGED if slot.commit() else BlockOutcome.STORED

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)
