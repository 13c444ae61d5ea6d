"""Eviction policies: which block leaves a tier first. Keys only; pins are the caller's business.

Each policy is one small class over an ordered map from key to nothing; the order is the eviction
order, oldest first. ``LRUPolicy`` moves a key to the back on every touch; ``FIFOPolicy`` is the
same class with ``touch`` turned off.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterator


class EvictionPolicy(ABC):
    """Tracks the keys a tier holds and proposes victims.

    Contract: ``insert`` adds a key that is not tracked (re-inserting a tracked key counts as a
    touch); ``touch`` and ``remove`` of an untracked key are no-ops; ``victims()`` yields every
    tracked key exactly once, best victim first, and must not be interleaved with mutations: the
    caller collects the keys it wants, stops iterating, then removes them.
    """

    @abstractmethod
    def insert(self, key: Hashable) -> None:
        """Start tracking ``key`` as the most recently used."""

    @abstractmethod
    def touch(self, key: Hashable) -> None:
        """Record an access to ``key``."""

    @abstractmethod
    def remove(self, key: Hashable) -> None:
        """Stop tracking ``key``."""

    @abstractmethod
    def victims(self) -> Iterator[Hashable]:
        """Tracked keys in eviction order, best victim first."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class FIFOPolicy(LRUPolicy):
    """First inserted first out: accesses do not reorder."""

    def touch(self, key: Hashable) -> None:
        pass


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "fifo": FIFOPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by name ("lru", "fifo"); ValueError names the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
