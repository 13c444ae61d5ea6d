"""Where a block lives: the tiers a hit is reported from (shared by the daemon and its clients)."""

from __future__ import annotations

import enum


class Tier(str, enum.Enum):
    """A tier's name as it travels on the wire and in stats (``str`` values)."""

    HBM = "hbm"
    DRAM = "dram"
    SSD = "ssd"
    REMOTE = "remote"

    def __str__(self) -> str:
        return self.value
