"""kvengine's blocks as the core's ``BlockSite``: its block ledger (the block manager).

A restore lands in blocks reserved for the sequence right after its HBM prefix hit: the
reservation is the ledger's ``admit`` of the hit (beside the blocks running prompts still need,
``owed_to_running``: a restore takes its whole hit at once and must not make a prompt being
prefilled preempt another), and the slots are the sequence's own block ids,
so a landed load needs no copy: the loaded blocks become computed tokens and join the prefix
cache. A save pins the blocks it reads. The daemon writes and reads kvengine's arena in place.
"""

from __future__ import annotations

from collections import Counter

from offload.core.block_site import BlockSite
from offload.core.restore_job import RestoreJob
from offload.core.slots import Reservation, Slots
from offload.engine_view import BlockLedger, OffloadSequence


class LedgerSite(BlockSite[OffloadSequence]):
    """Restores reserve through ``admit``; saves and quarantines pin (step thread only)."""

    def __init__(self, ledger: BlockLedger, counters: Counter[str]) -> None:
        self.ledger = ledger
        self.block_size = ledger.block_size
        self.counters = counters

    def reserve(self, job: RestoreJob[OffloadSequence]) -> Slots | Reservation:
        seq = job.owner
        # The HBM prefix may have changed since the lookup was sent: restore only onto the
        # exact prefix it was asked for.
        hbm_hits = self.ledger.match_prefix(seq)
        if len(hbm_hits) != job.first_block:
            self.counters["restores_prefix_changed"] += 1
            return Reservation.REFUSE
        if not self.ledger.admit(seq, hbm_hits, job.num_hit * self.block_size,
                                 keep_free_blocks=self.ledger.owed_to_running):
            return Reservation.WAIT  # no room beside what the running prompts still need
        return Slots(seq.block_ids[job.first_block:job.first_block + job.num_hit])

    def reserve_ahead(self, owner: OffloadSequence, first_block: int,
                      num_blocks: int) -> Slots | None:
        """The blocks right after the HBM hit, for every block asked: the sequence's own blocks
        for those tokens, whatever part of them the store turns out to hold."""
        hbm_hits = self.ledger.match_prefix(owner)
        if len(hbm_hits) != first_block or not self.ledger.admit(
                owner, hbm_hits, num_blocks * self.block_size,
                keep_free_blocks=self.ledger.owed_to_running):
            return None
        return Slots(owner.block_ids[first_block:first_block + num_blocks])

    def land(self, job: RestoreJob[OffloadSequence], num_loaded: int) -> None:
        """The loaded blocks are computed tokens now, cached like computed ones; the blocks
        past them stay the sequence's, to be computed."""
        seq = job.owner
        seq.num_computed_tokens = (job.first_block + num_loaded) * self.block_size
        self.ledger.register_computed_blocks(seq)

    def unreserve(self, job: RestoreJob[OffloadSequence], quarantined: bool) -> None:
        """The sequence starts over on fresh blocks; quarantined ones stay pinned."""
        if quarantined and job.slots is not None:
            self.ledger.pin(job.slots.block_ids)
        self.ledger.free(job.owner)
        job.owner.num_computed_tokens = 0

    def release(self, slots: Slots) -> None:
        self.ledger.unpin(slots.block_ids)

    def pin_for_save(self, block_ids: list[int]) -> Slots:
        self.ledger.pin(block_ids)  # not reused before the store has the bytes
        return Slots(list(block_ids))

    def unpin_after_save(self, slots: Slots) -> None:
        self.ledger.unpin(slots.block_ids)
