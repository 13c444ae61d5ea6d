"""The HBM tier's index: which full blocks sit in which registered engine's arena, at which id.

An engine that shares its block generations publishes (``resident``) the blocks its prefix cache
holds: block id, hash, ident and the generation the block had when it was filled. An entry is a
claim, never trusted on its own: it is good only while the engine's generation counter of that
block still equals the published one (the engine bumps it whenever it reallocates the block,
before anything can write it), and a hit is verified against the ident like any store hit.
Entries leave when the engine publishes the eviction, when a lookup or a copy finds their
generation moved on, and all at once when the registration closes. One entry per (registration,
block id): a new publication for a block replaces the old one, so the index never holds more
entries than the registered engines have blocks.

Thread-safe: lookups and publications run on the daemon's event loop, copies and disconnects on
worker threads.

Each hash whose last entry went is noted, for ``drain_left`` to hand on (a cluster withdraws
what the node no longer holds); the owner drains after every change, so the notes stay few.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.engines.registration import Registration


@dataclass(eq=False, slots=True)
class HbmEntry:
    """Block ``block_id`` of ``reg`` held the block (``namespace``, ``block_hash``) as of
    ``generation``."""

    reg: Registration
    block_id: int
    generation: int
    namespace: bytes
    block_hash: bytes
    ident: bytes

    def current(self) -> bool:
        """The block still holds what was published (a fresh read of its generation)."""
        return self.reg.generation(self.block_id) == self.generation


# Outcomes counted here; present from the start so exported series never appear late.
COUNTERS = ("published", "published_stale", "withdrawn", "dropped_stale", "dropped_closed",
            "collisions")


class HbmIndex:
    """Published resident blocks by (namespace, hash) and by (registration, block id)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_hash: dict[bytes, dict[bytes, list[HbmEntry]]] = {}  # namespace -> hash -> ...
        self._by_reg: dict[int, dict[int, HbmEntry]] = {}  # registration id -> block id -> ...
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._left: deque[tuple[bytes, bytes]] = deque()  # (namespace, hash): no entry left

    def publish(self, reg: Registration, namespace: bytes, block_ids: Sequence[int],
                hashes: Sequence[bytes], idents: Sequence[bytes],
                generations: Sequence[int]) -> list[bytes]:
        """Index blocks of ``reg`` (ids already checked); returns the hashes of those that were
        current (indexed)."""
        indexed: list[bytes] = []
        with self._lock:
            if reg.closed:
                return indexed
            blocks = self._by_reg.setdefault(reg.registration_id, {})
            table = self._by_hash.setdefault(namespace, {})
            for block_id, block_hash, ident, gen in zip(block_ids, hashes, idents, generations):
                old = blocks.pop(block_id, None)
                if old is not None:
                    self._unlink_locked(old)
                if reg.generation(block_id) != gen:  # reallocated since the engine published
                    self.counters["published_stale"] += 1
                    continue
                entry = HbmEntry(reg, block_id, gen, namespace, block_hash, ident)
                blocks[block_id] = entry
                table.setdefault(block_hash, []).append(entry)
                indexed.append(block_hash)
            if not table:
                del self._by_hash[namespace]
            if not blocks:
                del self._by_reg[reg.registration_id]
            self.counters["published"] += len(indexed)
        return indexed

    def withdraw(self, regs: Sequence[Registration], namespace: bytes,
                 hashes: Sequence[bytes]) -> int:
        """The engine(s) evicted these blocks: forget their entries; returns how many went."""
        reg_ids = {r.registration_id for r in regs}
        num_removed = 0
        with self._lock:
            table = self._by_hash.get(namespace)
            if not table:
                return 0
            for block_hash in hashes:
                entries = table.get(block_hash)
                if not entries:
                    continue
                for entry in [e for e in entries if e.reg.registration_id in reg_ids]:
                    self._remove_locked(entry)
                    num_removed += 1
            self.counters["withdrawn"] += num_removed
        return num_removed

    def drop_registration(self, reg: Registration) -> int:
        """The registration closed: every entry of it goes; returns how many."""
        with self._lock:
            blocks = self._by_reg.pop(reg.registration_id, None) or {}
            for entry in blocks.values():
                self._unlink_locked(entry)
            self.counters["dropped_closed"] += len(blocks)
        return len(blocks)

    def discard(self, entry: HbmEntry) -> None:
        """A copy found the entry's block reallocated: forget it (if still indexed)."""
        with self._lock:
            blocks = self._by_reg.get(entry.reg.registration_id)
            if blocks is not None and blocks.get(entry.block_id) is entry:
                self._remove_locked(entry)
                self.counters["dropped_stale"] += 1

    def hashes(self) -> list[bytes]:
        """Every published hash (any namespace), as of the call."""
        with self._lock:
            return [h for table in self._by_hash.values() for h in table]

    def holds(self, namespace: bytes) -> bool:
        """Any entry in ``namespace`` (a hint: read without the lock)."""
        return bool(self._by_hash.get(namespace))

    def holding(self, namespace: bytes, hashes: Sequence[bytes]) -> list[bool]:
        """Per hash, whether any registration has an entry for it (current or not)."""
        with self._lock:
            table = self._by_hash.get(namespace) or {}
            return [bool(table.get(h)) for h in hashes]

    def drain_left(self) -> dict[bytes, list[bytes]]:
        """The hashes noted since the last call as having lost their last entry, by namespace;
        some may have come back since (ask ``holding``)."""
        left: dict[bytes, list[bytes]] = {}
        while self._left:
            try:
                namespace, block_hash = self._left.popleft()
            except IndexError:  # another thread drained it meanwhile
                break
            left.setdefault(namespace, []).append(block_hash)
        return left

    def find(self, namespace: bytes, hashes: Sequence[bytes], idents: Sequence[bytes],
             usable: Callable[[Registration], bool]) -> list[HbmEntry | None] | None:
        """Per hash, a current, verified entry of a ``usable`` registration, or None; None
        instead of the list when no hash has one (the common case costs one dict lookup)."""
        table = self._by_hash.get(namespace)
        if not table:
            return None
        candidates = list(map(table.get, hashes))
        if not any(candidates):
            return None
        found: list[HbmEntry | None] = [None] * len(hashes)
        fit: dict[int, bool] = {}  # usable() per registration id, asked once per lookup
        picked: dict[int, list[int]] = {}  # registration id -> indices whose entry it holds
        with self._lock:
            for i, entries in enumerate(candidates):
                if not entries:
                    continue
                for entry in entries:
                    reg_id = entry.reg.registration_id
                    ok = fit.get(reg_id)
                    if ok is None:
                        ok = fit[reg_id] = usable(entry.reg)
                    if not ok:
                        continue
                    if entry.ident != idents[i]:
                        self.counters["collisions"] += 1
                        continue
                    found[i] = entry
                    picked.setdefault(reg_id, []).append(i)
                    break
            # The generations of each registration's picks in one read: an entry whose block
            # was reallocated (its eviction is on its way) is dropped, and that block misses.
            for indices in picked.values():
                entries = [found[i] for i in indices]
                now = entries[0].reg.generations_of([e.block_id for e in entries])
                want = np.fromiter((e.generation for e in entries), dtype=np.uint64,
                                   count=len(entries))
                if now is not None and np.array_equal(now, want):
                    continue
                for k, (i, entry) in enumerate(zip(indices, entries)):
                    if now is None or int(now[k]) != entry.generation:
                        found[i] = None
                        self._remove_locked(entry)
                        self.counters["dropped_stale"] += 1
        return found if any(found) else None

    def held_prefixes(self, namespace: bytes, hashes: Sequence[bytes],
                      idents: Sequence[bytes]) -> dict[int, int]:
        """Per registration id, how many leading blocks of the chain it holds: entries whose
        ident matches and whose generation is still the published one. Read only: a stale
        entry found here stays for ``find`` or the eviction to drop. Registrations holding
        none of it are left out."""
        table = self._by_hash.get(namespace)
        if not table or not hashes:
            return {}
        held: dict[int, int] = {}
        with self._lock:
            runs: dict[int, list[HbmEntry]] = {}  # registration id -> its entries, in order
            for i, block_hash in enumerate(hashes):
                entries = table.get(block_hash)
                if not entries:
                    break
                extended = False
                for entry in entries:
                    run = runs.setdefault(entry.reg.registration_id, []) if i == 0 else \
                        runs.get(entry.reg.registration_id)
                    # A run still growing is exactly i long; one block per registration and step.
                    if run is None or len(run) != i or entry.ident != idents[i]:
                        continue
                    run.append(entry)
                    extended = True
                if not extended:
                    break
            # One generation read per registration: the run ends at its first reallocated block.
            for reg_id, run in runs.items():
                if not run or run[0].reg.closed:
                    continue
                now = run[0].reg.generations_of([e.block_id for e in run])
                if now is None:
                    continue
                want = np.fromiter((e.generation for e in run), dtype=np.uint64, count=len(run))
                same = np.asarray(now) == want
                num_held = len(run) if same.all() else int(np.argmin(same))
                if num_held:
                    held[reg_id] = num_held
        return held

    def stats(self) -> dict:
        with self._lock:
            num_blocks = sum(len(blocks) for blocks in self._by_reg.values())
            return {"blocks": num_blocks, "registrations": len(self._by_reg),
                    "index": dict(self.counters)}

    def __len__(self) -> int:
        with self._lock:
            return sum(len(blocks) for blocks in self._by_reg.values())

    def _remove_locked(self, entry: HbmEntry) -> None:
        blocks = self._by_reg.get(entry.reg.registration_id)
        if blocks is not None and blocks.get(entry.block_id) is entry:
            del blocks[entry.block_id]
            if not blocks:
                del self._by_reg[entry.reg.registration_id]
        self._unlink_locked(entry)

    def _unlink_locked(self, entry: HbmEntry) -> None:
        table = self._by_hash.get(entry.namespace)
        if table is None:
            return
        entries = table.get(entry.block_hash)
        if entries is None:
            return
        try:
            entries.remove(entry)
        except ValueError:
            return
        if not entries:
            del table[entry.block_hash]
            self._left.append((entry.namespace, entry.block_hash))
            if not table:
                del self._by_hash[entry.namespace]
