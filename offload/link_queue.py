"""LinkQueue: the requests an engine's step thread hands its link's thread, urgent ones first.

A lookup is urgent: a request waits in the scheduler for its reply, and it names no registered
memory, so it may overtake saves and publications queued before it (a claim of HBM residency it
could see early or late is checked by the daemon by block generation; a block a queued save has
not stored yet is in this engine's HBM, which the lookup starts past). Saves, loads and
publications keep their order among themselves: their order is their meaning.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class QueueFull(Exception):
    """More than ``max_queued`` requests wait for the link's thread: the store is too far
    behind."""


class LinkQueue(Generic[T]):
    """Two FIFO lanes under one bound (``max_queued`` items in all); ``get`` takes the urgent
    lane's oldest first. ``None`` is a wake-up (``wake``), taken before anything else. Any
    thread may put; one thread takes."""

    def __init__(self, max_queued: int) -> None:
        if max_queued <= 0:
            raise ValueError(f"max_queued must be positive, got {max_queued}")
        self.max_queued = max_queued
        self._urgent: deque[T] = deque()
        self._normal: deque[T] = deque()
        self._wakes = 0
        self._ready = threading.Condition(threading.Lock())

    def __len__(self) -> int:
        with self._ready:
            return len(self._urgent) + len(self._normal)

    def put(self, item: T, urgent: bool = False) -> None:
        """Queue ``item`` behind the others of its lane; QueueFull at the bound."""
        with self._ready:
            if len(self._urgent) + len(self._normal) >= self.max_queued:
                raise QueueFull(f"{self.max_queued} requests queued for the link")
            (self._urgent if urgent else self._normal).append(item)
            self._ready.notify()

    def wake(self) -> None:
        """Make the taking thread's ``get`` return (None) now, whatever the bound."""
        with self._ready:
            self._wakes += 1
            self._ready.notify()

    def get(self, timeout_s: float) -> T | None:
        """The next item (urgent lane first), or None on a wake-up or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._ready:
            while not (self._wakes or self._urgent or self._normal):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._ready.wait(left)
            return self._take()

    def take_all(self) -> list[T]:
        """Empty both lanes (urgent first) and return what they held."""
        with self._ready:
            items = [*self._urgent, *self._normal]
            self._urgent.clear()
            self._normal.clear()
            return items

    def _take(self) -> T | None:
        if self._wakes:
            self._wakes -= 1
            return None
        return (self._urgent or self._normal).popleft()
