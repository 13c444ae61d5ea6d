"""What every part of the tiered store shares: its lock, its tiers in order, its counters, and
the reports of blocks that left every tier.

The read path, the write path, the demoter, the promoter and the lease pins are each handed one
``StoreParts`` and take what they use of it; the tiers in it keep the contract of
``store_tier.py``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvstore.store.dram.tier import DramTier
from kvstore.store.drop_reports import DropReports
from kvstore.store.guard import StoreGuard
from kvstore.store.store_tier import BackingTier, StoreTier


@dataclass(frozen=True)
class StoreParts:
    """The store's shared parts. ``backing`` is the tier behind DRAM: the SSD tier, or the null
    tier when there is none (never None). ``counters`` holds the store's counted outcomes
    (``tiered.COUNTERS``), changed only under ``guard``'s lock."""

    guard: StoreGuard
    dram: DramTier
    backing: BackingTier
    counters: Counter[str]
    drops: DropReports

    @property
    def tiers(self) -> tuple[StoreTier, ...]:
        """Every tier, fastest first: the order a lookup walks them in."""
        return (self.dram, self.backing)
