"""The backing tier when there is none (``--ssd-size 0``): it holds nothing, takes nothing,
and says so in its stats (``enabled: False``), so the store's parts need no "is there an SSD?"
check: every lookup in it misses and every write to it is refused."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvstore.store.store_tier import BackingTier, BlockWrite
from kvstore.tiers import Tier


class NullTier(BackingTier[object]):
    """A switched-off backing tier; it reports as ``tier`` (the SSD's place in ``/stats``)."""

    def __init__(self, tier: Tier = Tier.SSD) -> None:
        self.tier = tier

    @property
    def enabled(self) -> bool:
        return False

    def lookup(self, key: bytes) -> None:
        return None

    def __contains__(self, key: bytes) -> bool:
        return False

    def keys(self) -> list[bytes]:
        return []

    def lookup_prefix(self, keys: Iterable[bytes]) -> list[object]:
        return []

    def contains(self, key: bytes, ident: bytes) -> bool:
        return False

    def pin_many(self, entries: Sequence[object]) -> int:
        return 0  # none of them is this tier's

    def unpin(self, entry: object) -> None:
        raise ValueError("unpin of an entry the null tier never pinned")

    def touch_many(self, entries: Iterable[object | None]) -> None:
        pass  # nothing is held, so no order to keep

    def write_many(self, items: Sequence[BlockWrite]) -> list[bool]:
        return [False] * len(items)

    def read_into(self, entry: object, dest: memoryview) -> bool:
        return False

    def remove(self, entry: object) -> bool:
        return False

    def stats(self) -> dict:
        return {"enabled": False, "capacity_bytes": 0, "used_bytes": 0, "blocks": 0}

    def check_integrity(self) -> None:
        pass  # nothing to account for

    def close(self) -> None:
        pass
