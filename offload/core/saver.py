"""The one save machine: pin blocks, send them, account the daemon's outcome per block.

Both engines save through this class against their ``BlockSite``. ``pin`` takes the blocks
inside the step (before the engine may free them); ``send_pinned`` puts them on the wire after
it (a job whose blocks are not ready yet, behind the step's compute, waits pinned for a later
call); ``poll`` ends the saves that were answered (or failed, or timed out), hands the slots back
and counts every block once: ``blocks_saved``, ``blocks_save_duplicate``, ``blocks_save_failed``,
``blocks_save_dropped`` (never sent) or ``blocks_save_skipped_*`` (never pinned).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from kvstore import StoreState
from offload.core.block_site import BlockSite
from offload.core.save_job import SaveJob
from offload.core.states import SaveOutcome, SaveState
from offload.store_client import StoreClient

_COUNTER = {SaveOutcome.SAVED: "blocks_saved", SaveOutcome.DUPLICATE: "blocks_save_duplicate",
            SaveOutcome.FAILED: "blocks_save_failed"}


def _both(first: Callable[[], bool] | None,
          second: Callable[[], bool] | None) -> Callable[[], bool] | None:
    """Ready once both are (None: no condition)."""
    if first is None or second is None:
        return first or second
    return lambda: first() and second()


class Saver:
    """Owns the saves of one engine's store client, pinned or in flight (step thread only)."""

    def __init__(self, client: StoreClient, site: BlockSite, counters: Counter[str],
                 deadline_s: float | None = None) -> None:
        self.client = client
        self.site = site
        self.counters = counters
        self.deadline_s = deadline_s  # the daemon's deadline for a save (None: the client's)
        self.pinned: list[SaveJob] = []
        self.in_flight: list[SaveJob] = []

    def pin(self, namespace: bytes, block_ids: list[int], hashes: list[bytes],
            idents: list[bytes], ready: Callable[[], bool] | None = None) -> SaveJob | None:
        """Have the site hold ``block_ids`` for a save (sent by ``send_pinned`` once
        ``ready`` and the slots' own ``ready``); None if the store is unavailable or the site
        has no room (counted, the blocks are not saved)."""
        if not len(block_ids) == len(hashes) == len(idents):
            raise ValueError(f"{len(block_ids)} block ids, {len(hashes)} hashes, "
                             f"{len(idents)} idents")
        if not self.client.available:
            self.counters["blocks_save_skipped_unavailable"] += len(block_ids)
            return None
        epoch = self.client.registration_epoch  # before the slots: they belong to this one
        slots = self.site.pin_for_save(list(block_ids))
        if slots is None:
            self.counters["blocks_save_skipped_no_room"] += len(block_ids)
            return None
        job = SaveJob(namespace, list(hashes), list(idents), slots, epoch,
                      ready=_both(ready, slots.ready))
        self.pinned.append(job)
        return job

    def send_pinned(self) -> None:
        """Send every pinned save that is ready (the link's thread writes them; nothing waits
        here)."""
        pinned, self.pinned = self.pinned, []
        for job in pinned:
            if job.ready is not None and not job.ready():
                self.pinned.append(job)
                continue
            if not self.client.available:  # gone since: nothing would land
                self._drop(job)
                continue
            job.call = self.client.save(job.namespace, job.slots.block_ids, job.hashes,
                                      job.idents, self.deadline_s, epoch=job.epoch)
            job.to(SaveState.SENT)
            self.counters["saves"] += 1
            self.in_flight.append(job)

    def poll(self) -> list[SaveJob]:
        """End the saves that finished since; their slots go back to the site."""
        ended, still = [], []
        for job in self.in_flight:
            assert job.call is not None
            if not job.call.poll():
                still.append(job)
                continue
            call = job.call
            if call.never_sent:
                self._drop(job)
            else:
                job.outcomes = ([SaveOutcome.parse(o) for o in call.result.outcomes]
                                if call.ok else [SaveOutcome.FAILED] * job.num_blocks)
                job.to(SaveState.ENDED)
                for outcome in job.outcomes:
                    self.counters[_COUNTER[outcome]] += 1
                self.site.unpin_after_save(job.slots, daemon_done=call.answered)
            ended.append(job)
        self.in_flight = still
        return ended

    def _drop(self, job: SaveJob) -> None:
        job.outcomes = [SaveOutcome.FAILED] * job.num_blocks
        job.to(SaveState.DROPPED)
        self.counters["blocks_save_dropped"] += job.num_blocks
        self.site.unpin_after_save(job.slots, daemon_done=True)

    def wait(self, jobs: list[SaveJob], timeout_s: float) -> list[SaveJob]:
        """Block until ``jobs`` ended (sending those pinned once ready) or ``timeout_s``
        passed; a hung store is not waited for. The saves that ended meanwhile (any, not only
        ``jobs``)."""
        deadline = time.monotonic() + timeout_s
        ended = self.poll()
        for job in jobs:
            while (not job.over and self.client.state is not StoreState.HUNG
                   and time.monotonic() < deadline):
                if job.state is SaveState.PINNED:
                    self.send_pinned()
                    if job.state is SaveState.PINNED:  # not ready yet: the device is busy
                        time.sleep(0.0005)
                        continue
                assert job.call is not None
                job.call.wait(min(0.05, max(0.0, deadline - time.monotonic())))
                ended += self.poll()
        return ended

    def wait_idle(self, timeout_s: float) -> list[SaveJob]:
        """Send what is pinned, then wait (bounded) until no save is pinned or in flight."""
        self.send_pinned()
        return self.wait(self.pinned + self.in_flight, timeout_s)
