"""The one save machine: pin blocks, send them, account the daemon's outcome per block.

Both engines save through this class against their ``BlockSite``. ``pin`` takes the blocks
inside the step (before the engine may free them); ``send_pinned`` puts them on the wire after
it (a job whose blocks are not ready yet, behind the step's compute, waits pinned for a later
call); ``poll`` ends the saves that were answered (or failed, or timed out), hands the slots back
and counts every block once: ``blocks_saved``, ``blocks_save_duplicate``, ``blocks_save_failed``,
``blocks_save_dropped`` (never sent), ``blocks_save_dropped_no_room`` (waited for room past the
save deadline), ``blocks_save_dropped_preempted`` (waited for room until the engine took the
blocks back) or ``blocks_save_skipped_*`` (never pinned).

A site whose slots are a bounded staging buffer (vLLM's) may have no room when a save is pinned:
the job then waits for room (``WAITING_FOR_ROOM``, counted ``saves_waited_for_room``), and each
``send_pinned`` asks the site again, oldest job first, as the saves in flight give their slots
back. The engine keeps the blocks meanwhile (vLLM: until ``finished_sending``), so nothing is
copied out of memory that was reused. A save that got no reply (its connection lost, its
deadline passed) leaves its slots, on either engine, in a ``Quarantine`` until a newer
registration of the same memory was accepted: the daemon may read them until then (it
publishes the copies it had in flight when the connection went), and they come back after,
not never.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from kvstore import StoreState
from offload.core.block_site import BlockSite
from offload.core.quarantine import Quarantine
from offload.core.save_job import SaveJob
from offload.core.slots import Reservation, Slots
from offload.core.states import SaveOutcome, SaveState
from offload.store_client import StoreClient

_UNSENT = (SaveState.WAITING_FOR_ROOM, SaveState.PINNED)
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
        self.quarantine = Quarantine(site, counters, lambda: client.registration_epoch)

    def pin(self, namespace: bytes, block_ids: list[int], hashes: list[bytes],
            idents: list[bytes], ready: Callable[[], bool] | None = None) -> SaveJob | None:
        """Have the site hold ``block_ids`` for a save (sent by ``send_pinned`` once
        ``ready`` and the slots' own ``ready``), or have the job wait for room where the site
        says WAIT (or older jobs still wait: room goes to them first). None if the store is
        unavailable or the site refuses (counted, the blocks are not saved)."""
        if not len(block_ids) == len(hashes) == len(idents):
            raise ValueError(f"{len(block_ids)} block ids, {len(hashes)} hashes, "
                             f"{len(idents)} idents")
        if not self.client.available:
            self.counters["blocks_save_skipped_unavailable"] += len(block_ids)
            return None
        job = SaveJob(namespace, list(hashes), list(idents), None,
                      self.client.registration_epoch, SaveState.WAITING_FOR_ROOM, ready=ready,
                      block_ids=list(block_ids),
                      room_deadline=time.monotonic() + self._room_wait_s)
        got = self._pin(job) if not self._anyone_waiting() else (
            Reservation.REFUSE if self.site.never_fits(len(block_ids)) else Reservation.WAIT)
        if got is Reservation.REFUSE:
            self.counters["blocks_save_skipped_no_room"] += len(block_ids)
            return None
        if got is Reservation.WAIT:
            self.counters["saves_waited_for_room"] += 1
        self.pinned.append(job)
        return job

    @property
    def _room_wait_s(self) -> float:
        """How long a save may wait for room: its deadline at the daemon."""
        return self.deadline_s if self.deadline_s is not None else self.client.timeout_s

    def _anyone_waiting(self) -> bool:
        return any(job.state is SaveState.WAITING_FOR_ROOM for job in self.pinned)

    def _pin(self, job: SaveJob) -> Slots | Reservation:
        """Ask the site for the job's slots; with them, the job is PINNED on the connection
        they were taken on."""
        epoch = self.client.registration_epoch  # before the slots: they belong to this one
        got = self.site.pin_for_save(job.block_ids)
        if isinstance(got, Slots):
            job.slots, job.epoch = got, epoch
            job.ready = _both(job.ready, got.ready)
            job.to(SaveState.PINNED)
        return got

    def send_pinned(self) -> None:
        """Pin the jobs waiting for room that the site has room for now (oldest first: a job
        waits behind older ones), drop those waiting past their deadline, and send every
        pinned save that is ready (the link's thread writes them; nothing waits here). A job
        that raises (the site's copy, the client) leaves the ones after it pinned."""
        pinned, self.pinned = self.pinned, []
        blocked = False  # an older job still waits for room: younger ones wait behind it
        now = time.monotonic()
        for i, job in enumerate(pinned):
            try:
                self._advance(job, blocked, now)
            except BaseException:
                self.pinned.extend(j for j in pinned[i:] if not j.over)
                raise
            blocked = blocked or job.state is SaveState.WAITING_FOR_ROOM

    def _advance(self, job: SaveJob, blocked: bool, now: float) -> None:
        """One pinned job: given room, dropped, sent, or kept in ``pinned`` for later."""
        if job.state is SaveState.WAITING_FOR_ROOM:
            if not self.client.available:  # its slots would belong to a lost connection
                self._drop(job)
                return
            got = Reservation.WAIT if blocked else self._pin(job)
            if got is Reservation.REFUSE:
                self._drop(job, "blocks_save_dropped_no_room")
                return
            if got is Reservation.WAIT:
                if now >= job.room_deadline:
                    self._drop(job, "blocks_save_dropped_no_room")
                else:
                    self.pinned.append(job)
                return
        if job.ready is not None and not job.ready():
            self.pinned.append(job)
            return
        if not self.client.available:  # gone since: nothing would land
            self._drop(job)
            return
        assert job.slots is not None
        job.call = self.client.save(job.namespace, job.slots.block_ids, job.hashes,
                                    job.idents, self.deadline_s, epoch=job.epoch)
        job.to(SaveState.SENT)
        self.counters["saves"] += 1
        self.in_flight.append(job)

    def drop_waiting(self, jobs: list[SaveJob]) -> None:
        """The engine takes these jobs' blocks back (a preemption): those still waiting for
        room are dropped (counted), as packing them later would read reused blocks."""
        waiting = [job for job in jobs if job.state is SaveState.WAITING_FOR_ROOM]
        for job in waiting:
            self.pinned.remove(job)
            self._drop(job, "blocks_save_dropped_preempted")

    def poll(self) -> list[SaveJob]:
        """End the saves that finished since; their slots go back to the site."""
        self.quarantine.poll()
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
                if call.answered:
                    self.site.unpin_after_save(job.slots)
                else:  # the daemon may still read them: back once it cannot
                    self.quarantine.hold(call, job.slots, self.site.unpin_after_save)
            ended.append(job)
        self.in_flight = still
        return ended

    def _drop(self, job: SaveJob, counter: str = "blocks_save_dropped") -> None:
        job.outcomes = [SaveOutcome.FAILED] * job.num_blocks
        job.to(SaveState.DROPPED)
        self.counters[counter] += job.num_blocks
        if job.slots is not None:
            self.site.unpin_after_save(job.slots)

    def wait(self, jobs: list[SaveJob], timeout_s: float) -> list[SaveJob]:
        """Block until ``jobs`` ended (sending those pinned once ready) or ``timeout_s``
        passed; a hung store is not waited for. The saves that ended meanwhile (any, not only
        ``jobs``)."""
        deadline = time.monotonic() + timeout_s
        ended = self.poll()
        for job in jobs:
            while (not job.over and self.client.state is not StoreState.HUNG
                   and time.monotonic() < deadline):
                if job.state in _UNSENT:
                    self.send_pinned()
                    if job.over:  # dropped: past its room's deadline, or the store went
                        ended.append(job)
                        continue
                if job.state is SaveState.WAITING_FOR_ROOM and self.in_flight:
                    # room comes back as the saves in flight end: wait for the oldest
                    oldest = self.in_flight[0].call
                    assert oldest is not None
                    oldest.wait(min(0.05, max(0.0, deadline - time.monotonic())))
                    ended += self.poll()
                    continue
                if job.state in _UNSENT:  # not ready yet (the device is busy), or no room
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
