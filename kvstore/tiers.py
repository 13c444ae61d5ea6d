"""Where a block lives: the tiers a hit is reported from (shared by the daemon and its clients)."""

from __future__ import annotations

import enum


class Tier(str, enum.Enum):
    """A tier's name as it travels on the wire and in stats (``str`` values)."""

    HBM = "hbm"  # on the wire: a block in some registered engine's arena
    # In an engine's usage: tokens copied from another engine's arena on the node (the engine's
    # own prefix cache is HBM there); the daemon never replies with it.
    HBM_PEER = "hbm_peer"
    DRAM = "dram"
    SSD = "ssd"
    REMOTE = "remote"

    def __str__(self) -> str:
        return self.value
