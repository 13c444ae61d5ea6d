"""The SSD tier's in-memory catalog: which blocks it holds, where, and in what eviction order.

Plain state under the SSD tier's lock: the live entries by key, the eviction policy, one offset
allocator per data file, and the "zombies" (entries dropped while pinned, whose slots are freed
at their last unpin). Dropping an entry queues its LMDB delete (``SSDIndex.note_delete``) so that
any later commit carries it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from kvstore.store.allocator import Allocation, OffsetAllocator, align_up
from kvstore.store.eviction import EvictionPolicy
from kvstore.store.ssd.files import ALIGNMENT
from kvstore.store.ssd.index import SSDEntry, SSDIndex

Placement = tuple[int, Allocation]  # (data file, slot)


class SSDCatalog:
    """Entries, policy and slot allocators of the SSD tier; every method needs the tier's lock."""

    def __init__(self, num_files: int, file_bytes: int, policy: EvictionPolicy, db: SSDIndex,
                 counters: Counter[str], on_drop: Callable[[bytes], None] | None = None) -> None:
        self._index: dict[bytes, SSDEntry] = {}
        self._policy = policy
        self._allocators = [OffsetAllocator(file_bytes, ALIGNMENT) for _ in range(num_files)]
        self._zombies: set[SSDEntry] = set()  # dropped while pinned: slot freed at last unpin
        self._db = db
        self._counters = counters
        # Told the key of every entry dropped for good (not one rewritten in place): it must
        # only take note (TieredStore reports drops outside its locks).
        self._on_drop = on_drop

    # -- finding ------------------------------------------------------------------------------

    def get(self, key: bytes) -> SSDEntry | None:
        return self._index.get(key)

    def prefix(self, keys: Iterable[bytes]) -> list[SSDEntry]:
        """Live entries of ``keys`` in order, up to the first key not held."""
        out: list[SSDEntry] = []
        index = self._index
        for key in keys:
            entry = index.get(key)
            if entry is None:
                break
            out.append(entry)
        return out

    def keys(self) -> set[bytes]:
        return set(self._index)

    # -- pins and accesses --------------------------------------------------------------------

    def pin_many(self, entries: Sequence[SSDEntry]) -> int:
        """Pin entries in order up to the first one dropped meanwhile; returns how many."""
        for n, entry in enumerate(entries):
            if not entry.live:
                return n
            entry.pins += 1
        return len(entries)

    def unpin(self, entry: SSDEntry) -> None:
        if entry.pins <= 0:
            raise ValueError("unpin of an unpinned SSD entry")
        entry.pins -= 1
        if entry.pins == 0 and not entry.live:
            self._zombies.discard(entry)
            self.free(entry.file_idx, entry.alloc)

    def touch_many(self, entries: Iterable[SSDEntry | None]) -> None:
        for entry in entries:
            if entry is not None and entry.live:
                self._policy.touch(entry.key)

    # -- slots and entries --------------------------------------------------------------------

    def place(self, num_bytes: int, dropped: list[SSDEntry]) -> Placement | None:
        """A slot in the file with most free space, evicting the oldest unpinned blocks."""
        allocators = self._allocators
        order = sorted(range(len(allocators)), key=lambda i: -allocators[i].free_bytes)
        while True:
            for file_idx in order:
                alloc = allocators[file_idx].allocate(num_bytes)
                if alloc is not None:
                    return file_idx, alloc
            victim = self._next_victim()
            if victim is None:
                return None
            self.drop(victim, dropped, "evictions")

    def reuse_slot(self, num_bytes: int, dropped: list[SSDEntry]) -> Placement | None:
        """A slot that held an evicted block (it is backed by real disk blocks: the disk was
        full)."""
        need = align_up(max(num_bytes, 1), ALIGNMENT)
        while (victim := self._next_victim()) is not None:
            self.drop(victim, dropped, "evictions")
            if victim.alloc.reserved_bytes >= need:
                alloc = self._allocators[victim.file_idx].allocate_at(victim.alloc.offset,
                                                                      num_bytes)
                if alloc is not None:
                    return victim.file_idx, alloc
        return None

    def _next_victim(self) -> SSDEntry | None:
        for key in self._policy.victims():
            entry = self._index[key]
            if entry.pins == 0:
                return entry
        return None

    def free(self, file_idx: int, alloc: Allocation) -> None:
        self._allocators[file_idx].free(alloc)

    def publish(self, entry: SSDEntry) -> None:
        """Make a durable entry visible (its slot is already allocated)."""
        self._index[entry.key] = entry
        self._policy.insert(entry.key)

    def drop(self, entry: SSDEntry, dropped: list[SSDEntry], counter: str) -> None:
        """Drop a live entry (counted under ``counter``); its slot goes at its last unpin."""
        if not entry.live:
            return
        entry.live = False
        del self._index[entry.key]
        self._policy.remove(entry.key)
        self._counters[counter] += 1
        dropped.append(entry)
        self._db.note_delete(entry)  # any commit from now on carries it; see SSDIndex
        if self._on_drop is not None and counter != "replaced":
            self._on_drop(entry.key)
        if entry.pins == 0:
            self.free(entry.file_idx, entry.alloc)
        else:
            self._zombies.add(entry)

    def load(self, entries: list[SSDEntry], valid_bytes: Sequence[int]) -> list[bytes]:
        """Take the entries LMDB held at start, newest first on overlap; the keys of those
        that point at missing, truncated or overlapping data (not taken)."""
        kept: list[SSDEntry] = []
        bad: list[bytes] = []
        for entry in sorted(entries, key=lambda e: -e.seq):  # on overlap the newest wins
            fits = (entry.file_idx < len(self._allocators) and entry.alloc.offset % ALIGNMENT == 0
                    and entry.alloc.offset + entry.num_bytes <= valid_bytes[entry.file_idx])
            if fits and self._allocators[entry.file_idx].allocate_at(
                    entry.alloc.offset, entry.num_bytes) is not None:
                kept.append(entry)
            else:
                bad.append(entry.key)
        for entry in reversed(kept):
            self.publish(entry)  # oldest written first: restart keeps write order
        return bad

    # -- reporting ----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def num_files(self) -> int:
        return len(self._allocators)

    @property
    def num_pinned(self) -> int:
        return sum(1 for e in self._index.values() if e.pins)

    @property
    def used_bytes(self) -> int:
        return sum(a.used_bytes for a in self._allocators)

    def max_seq(self) -> int:
        return max((e.seq for e in self._index.values()), default=0)

    def check_integrity(self, idle: bool) -> None:
        """Allocators tile their files, index and policy agree; when ``idle`` (no write in
        flight) the allocations are exactly the live and zombie entries' slots."""
        held: list[set[tuple[int, int]]] = [set() for _ in self._allocators]
        for allocator in self._allocators:
            allocator.check_integrity()
        for key, e in self._index.items():
            assert e.live and e.key == key, f"index entry {key.hex()} is not live"
            held[e.file_idx].add((e.alloc.offset, e.alloc.reserved_bytes))
        assert set(self._policy.victims()) == set(self._index), "policy and index differ"
        if not idle:
            return
        for e in self._zombies:
            held[e.file_idx].add((e.alloc.offset, e.alloc.reserved_bytes))
        for i, allocator in enumerate(self._allocators):
            assert set(allocator.allocations()) == held[i], f"file {i}: allocations"
