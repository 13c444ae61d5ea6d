"""Blocks a load may still write: held out of use until the daemon has answered for them.

A load given up without a reply (its deadline passed, or the store hung) leaves the daemon free
to write into its blocks later. They are pinned here; once the load's reply does come in, the
daemon is done with them and they are given back. A load that ends with no reply at all (the
connection lost, its deadline passed) keeps them for good: counted, never reused.
"""

from __future__ import annotations

from collections import Counter

from offload.engine_view import BlockLedger
from offload.transfer import Transfer


class Quarantine:
    """Pinned blocks per abandoned load (step thread only)."""

    def __init__(self, ledger: BlockLedger, counters: Counter[str]) -> None:
        self.ledger = ledger
        self.counters = counters
        self._held: list[tuple[Transfer, list[int]]] = []

    def hold(self, load: Transfer, block_ids: list[int]) -> None:
        self.ledger.pin(block_ids)
        self.counters["blocks_quarantined"] += len(block_ids)
        if not load.done:
            self._held.append((load, block_ids))

    def poll(self) -> None:
        """Give back the blocks of loads the daemon has answered since."""
        still = []
        for load, block_ids in self._held:
            if not load.poll():
                still.append((load, block_ids))
            elif load.answered:
                self.ledger.unpin(block_ids)
                self.counters["blocks_quarantine_released"] += len(block_ids)
        self._held = still

    @property
    def num_held(self) -> int:
        return sum(len(ids) for _, ids in self._held)
