"""SlotPool: the free slots of a staging buffer, lent to transfers and given back.

Both staging buffers (the CPU path's shared memory, ``staging.py``, and vLLM's device staging,
``device_staging.py``) lend whole-block slots the same way: all or nothing, lowest first, and a
slot comes back once nothing reads or writes it any more. On the device that is later than the
give-back: a launch queued on a stream may still use the slot, so it comes back only once an
event recorded after that launch has completed (``after``, anything with ``query()``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any


class SlotPool:
    """``num_slots`` slots, ids ``0 .. num_slots - 1``; one thread (the engine's step)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError("a slot pool needs at least one slot")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end
        self._returning: deque[tuple[Any, list[int]]] = deque()  # (event, slots), in order

    @property
    def num_free(self) -> int:
        """Slots free now (those whose last use has not completed yet not counted)."""
        self._reclaim()
        return len(self._free)

    def take(self, num_slots: int) -> list[int] | None:
        """``num_slots`` free slots, or None when fewer are free (nothing taken)."""
        self._reclaim()
        if num_slots > len(self._free):
            return None
        return [self._free.pop() for _ in range(num_slots)]

    def give_back(self, slots: Iterable[int], after: Any = None) -> None:
        """The slots are free now, or (``after``) once ``after.query()`` is true; events are
        checked in the order they were given back (a stream's are completed in that order)."""
        slots = list(slots)
        if not slots:
            return
        if after is None and not self._returning:
            self._free.extend(slots)
        else:
            self._returning.append((after, slots))

    def _reclaim(self) -> None:
        while self._returning:
            after, slots = self._returning[0]
            if after is not None and not after.query():
                return
            self._returning.popleft()
            self._free.extend(slots)
