"""Slots a load may still write: held out of use until the daemon has answered for them.

A load given up before its reply (the store hung, the deadline passed) leaves the daemon free to
write into its slots later. They stay here; once the reply does come in (or the request turns
out never to have been sent) the daemon is done with them and the site gets them back. A load
that ends with no reply at all keeps them for good: counted, never reused.
"""

from __future__ import annotations

from collections import Counter

from offload.core.block_site import BlockSite
from offload.core.slots import Slots
from offload.transfer import Transfer


class Quarantine:
    """Held slots per abandoned load (step thread only)."""

    def __init__(self, site: BlockSite, counters: Counter[str]) -> None:
        self.site = site
        self.counters = counters
        self._held: list[tuple[Transfer, Slots]] = []

    def hold(self, load: Transfer, slots: Slots) -> None:
        self.counters["blocks_quarantined"] += len(slots.block_ids)
        self._held.append((load, slots))
        self.poll()

    def poll(self) -> None:
        """Give back the slots of loads the daemon has answered since."""
        still = []
        for load, slots in self._held:
            if not load.poll():
                still.append((load, slots))
            elif load.answered or load.never_sent:
                self.site.release(slots)
                self.counters["blocks_quarantine_released"] += len(slots.block_ids)
            else:
                self.counters["blocks_quarantined_for_good"] += len(slots.block_ids)
        self._held = still

    @property
    def num_held(self) -> int:
        """Blocks waiting for their load's reply (not those held for good)."""
        return sum(len(slots.block_ids) for _, slots in self._held)
