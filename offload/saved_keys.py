"""The keys this engine believes the store holds: acknowledged saves and restored blocks.

Bounded (oldest first out) and only a hint: a key found here is not saved again; one dropped from
here is at worst saved again and answered "duplicate". ``clear`` forgets everything, for a store
met again that may have lost what it held (a restart).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable


class SavedKeys:
    """An insertion-ordered set of at most ``max_keys`` block keys."""

    def __init__(self, max_keys: int) -> None:
        if max_keys <= 0:
            raise ValueError("max_keys must be positive")
        self.max_keys = max_keys
        self._keys: dict[bytes, None] = {}  # insertion order is age

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: Iterable[bytes]) -> None:
        """Remember ``keys``; the oldest go once over the bound."""
        self._keys.update(dict.fromkeys(keys))
        excess = len(self._keys) - self.max_keys
        if excess > 0:
            for key in list(itertools.islice(self._keys, excess)):
                del self._keys[key]

    def clear(self) -> None:
        self._keys.clear()
