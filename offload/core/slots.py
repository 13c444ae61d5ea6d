"""Slots: the daemon-side block ids a site lends one transfer, and what a site says instead."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Slots:
    """Daemon-side block ids lent to one transfer, and the memory they belong to (a site that
    makes new memory per registration, as vLLM's staging buffer, tells them apart by it).
    ``ready``: for slots a save's blocks are still being copied into on the device (vLLM's
    device staging), whether that copy has completed; None: complete when lent."""

    block_ids: list[int]
    memory: Any = None
    ready: Callable[[], bool] | None = None


class Reservation(enum.Enum):
    """``BlockSite.reserve``'s and ``pin_for_save``'s answer when it has no slots to give."""

    WAIT = "wait"  # no room now; ask again next poll (bounded by the slot wait or save deadline)
    REFUSE = "refuse"  # never: the restore is given up, the save skipped
