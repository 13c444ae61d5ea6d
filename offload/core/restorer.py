"""The one restore state machine: lookup -> lease -> slots -> load -> landed, or given up.

Restored ahead (``look_up_and_load``), a job reserves its slots before the lookup goes out and
the daemon loads the hit in the same round trip (``lookup_load``): one reply instead of a reply,
a load and another reply. A hit the daemon did not load (a slower tier, too short) comes back
leased and goes on as any leased hit, into the slots already held.

Both engines restore through this class; they differ only in their ``BlockSite`` (where blocks
land) and their ``RestoreDecider`` (whether a hit is worth loading). ``poll`` advances every
tracked job without waiting; a store that hangs, drops the connection, or never answers ends
the jobs that wait on it (``GIVEN_UP``, with the reason counted), and slots the daemon may still
write stay quarantined until it answers, or until a newer registration replaced its connection
(``Quarantine``). Each job ends exactly once, counted as
``restores_<end>``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic

from kvstore import StoreState, Tier
from offload.core.block_site import BlockSite
from offload.core.decider import RestoreDecider
from offload.core.quarantine import Quarantine
from offload.core.restore_job import Owner, RestoreJob
from offload.core.slots import Reservation, Slots
from offload.core.states import RestoreEnd, RestoreState
from offload.store_client import StoreClient
from offload.transfer import Transfer

State, End = RestoreState, RestoreEnd
# While nothing but restores is left to run, the step thread waits for their replies in slices
# this long, checking between them whether to go on waiting (new work arrived).
PROGRESS_POLL_S = 0.0002


@dataclass(frozen=True)
class RestoreSettings:
    """How long a restore may wait on each thing, and the lease it asks for (the defaults are
    kvengine's; vLLM's worker bounds them all by its load timeout)."""

    lease_ttl_s: float = 30.0  # a lease lives this long without its load
    # An unanswered lookup is given up after this and the blocks recomputed (the store answers
    # in well under a millisecond; a hung one is given up sooner, once its probe is overdue).
    max_lookup_wait_s: float = 1.5
    # A leased hit whose slots cannot be reserved yet retries every step for this long (well
    # inside the TTL), then gives up and recomputes.
    max_slot_wait_s: float = 5.0
    load_deadline_s: float | None = None  # the daemon's deadline for a load (None: the client's)

    def __post_init__(self) -> None:
        for name in ("lease_ttl_s", "max_lookup_wait_s", "max_slot_wait_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_slot_wait_s >= self.lease_ttl_s > 0:
            raise ValueError("max_slot_wait_s must be shorter than the lease's TTL")


_TIERS_BY_NAME = {tier.value: tier for tier in Tier}


def known_tiers(names: list[str]) -> list[Tier]:
    """The reply's tiers up to the first one this client does not know (the hit ends there:
    a block whose tier is unknown is not loaded). A dict lookup a block: ``Tier(name)`` costs
    about 1 us each, a millisecond's tenth on a restore of a hundred blocks."""
    out = []
    for name in names:
        tier = _TIERS_BY_NAME.get(name) if isinstance(name, str) else None
        if tier is None:
            break
        out.append(tier)
    return out


def _unanswered(request: Transfer) -> RestoreEnd:
    """How a load or lookup_load that went out and got no reply ended (its slots quarantined)."""
    return End.LOAD_TIMEOUT if request.timed_out else End.LOAD_LOST


class Restorer(Generic[Owner]):
    """Owns the restores of one engine's store client (step thread only)."""

    def __init__(self, client: StoreClient, site: BlockSite[Owner], decider: RestoreDecider,
                 counters: Counter[str], settings: RestoreSettings | None = None) -> None:
        self.client = client
        self.site = site
        self.decider = decider
        self.counters = counters
        self.settings = settings or RestoreSettings()
        self.quarantine = Quarantine(site, counters, lambda: client.registration_epoch)
        self._jobs: list[RestoreJob[Owner]] = []  # tracked: advanced by ``poll``

    # -- starting and stopping ----------------------------------------------------------------

    def look_up(self, owner: Owner, namespace: bytes, hashes: list[bytes], idents: list[bytes],
                first_block: int = 0, busy: bool = True) -> RestoreJob[Owner]:
        """Send the lookup of a chain; the job is LOOKING_UP and not started yet (``start``
        it, or ``drop`` it if nobody will use its reply)."""
        lookup = self.client.lookup(namespace, hashes, idents, self.settings.lease_ttl_s)
        self.counters["lookups"] += 1
        return RestoreJob(owner, namespace, list(hashes), list(idents), lookup, first_block,
                          busy)

    def look_up_and_load(self, owner: Owner, namespace: bytes, hashes: list[bytes],
                         idents: list[bytes], first_block: int, busy: bool,
                         min_blocks: int) -> RestoreJob[Owner] | None:
        """Reserve slots for every block of the chain and send a lookup the daemon loads at once
        (a hit of at least ``min_blocks``, all in HBM or DRAM); the job is tracked from now on.
        None (nothing sent, nothing held) when the site cannot reserve ahead."""
        slots = self.site.reserve_ahead(owner, first_block, len(hashes))
        if slots is None:
            return None
        lookup = self.client.lookup_load(namespace, hashes, idents, slots.block_ids,
                                         self.settings.lease_ttl_s, min_blocks,
                                         self.settings.load_deadline_s,
                                         epoch=self.client.registration_epoch)
        self.counters["lookups"] += 1
        job = RestoreJob(owner, namespace, list(hashes), list(idents), lookup, first_block,
                         busy, slots=slots, ahead=True)
        self.decider.load_started(job)
        self._jobs.append(job)
        return job

    def start(self, job: RestoreJob[Owner]) -> bool:
        """Advance ``job`` once now and, unless that ended it (True), track it: from then on
        ``poll`` advances it until it ends."""
        if job.over or job in self._jobs:
            raise ValueError(f"restore already {'ended' if job.over else 'started'}")
        if self.advance(job, self.client.state is StoreState.HUNG):
            return True
        self._jobs.append(job)
        return False

    def drop(self, job: RestoreJob[Owner]) -> None:
        """An untracked LOOKING_UP job nobody will use: its lease is released once the reply
        comes (not counted as a restore)."""
        if job.state is not State.LOOKING_UP or job in self._jobs:
            raise ValueError("only an untracked lookup can be dropped")
        self.client.disown(job.lookup)

    def abort(self, job: RestoreJob[Owner]) -> bool:
        """The owner is gone. True if a load into its slots is still in flight: the job ends
        (ABORTED, its slots handed back through ``unreserve``) when the load answers. False
        if it ended now (nothing of the owner's is held)."""
        if job.over:
            return False
        if job.state is State.LOADING or job.ahead and job.state is State.LOOKING_UP:
            job.aborted = True
            return True
        if job.state is State.LOOKING_UP:
            self.client.disown(job.lookup)
        else:
            self._release_lease(job)
        self._end(job, State.GIVEN_UP, End.ABORTED)
        if job in self._jobs:
            self._jobs.remove(job)
        return False

    # -- advancing ------------------------------------------------------------------------------

    def poll(self) -> list[RestoreJob[Owner]]:
        """Advance every tracked job once, without waiting; the jobs that ended."""
        self.client.release_disowned()
        self.quarantine.poll()
        if not self._jobs:
            return []
        hung = self.client.state is StoreState.HUNG
        ended = [job for job in self._jobs if self.advance(job, hung)]
        if ended:
            self._jobs = [job for job in self._jobs if not job.over]
        return ended

    def advance(self, job: RestoreJob[Owner], hung: bool = False) -> bool:
        """One step of ``job`` (``hung``: the store stopped answering); True once it ended."""
        now = time.monotonic()
        if job.state is State.LOOKING_UP and job.ahead:
            self._take_ahead_reply(job, hung, now)
        elif job.state is State.LOOKING_UP:
            self._take_reply(job, hung, now)
        if job.state in (State.LEASED, State.WAITING_FOR_SLOTS):
            if hung:  # nothing reserved yet: the owner recomputes now, not after the slot wait
                self._release_lease_later(job)
                self._end(job, State.GIVEN_UP, End.STORE_HUNG)
            else:
                self._reserve_and_load(job, now)
        elif job.state is State.LOADING:
            self._take_load(job, hung, now)
        return job.over

    def _take_reply(self, job: RestoreJob[Owner], hung: bool, now: float) -> None:
        """LOOKING_UP -> LEASED, or GIVEN_UP (no reply in time, a miss, declined)."""
        lookup = job.lookup
        if not lookup.poll():
            if hung:
                self.client.disown(lookup)
                self._end(job, State.GIVEN_UP, End.STORE_HUNG)
            elif now - lookup.started_at > self.settings.max_lookup_wait_s:
                self.client.disown(lookup)
                self._end(job, State.GIVEN_UP, End.LOOKUP_TIMEOUT)
            return
        reply = lookup.result if lookup.ok else None
        if reply is None:
            self._end(job, State.GIVEN_UP, End.LOOKUP_FAILED)
            return
        tiers = known_tiers(list(reply.tiers)[:min(int(reply.num_hit), job.num_asked)])
        if not tiers or not reply.lease_id:
            if reply.lease_id:
                self.client.release(reply.lease_id)
            self._end(job, State.GIVEN_UP, End.MISS)
            return
        job.lease_id, job.tiers, job.num_hit = reply.lease_id, tiers, len(tiers)
        job.to(State.LEASED)
        if not self.decider.worth_loading(job):
            self._release_lease(job)
            self._end(job, State.GIVEN_UP, End.DECLINED)

    def _take_ahead_reply(self, job: RestoreJob[Owner], hung: bool, now: float) -> None:
        """A ``lookup_load``'s reply: LANDED (loaded), LEASED -> LOADING (a hit left to this
        side, found worth loading), or GIVEN_UP. Its slots are held throughout; with no reply
        they stay quarantined, as a load's."""
        lookup = job.lookup
        assert job.slots is not None
        if not lookup.poll():
            if hung:
                self._abandon_ahead(job, End.STORE_HUNG, now)
            return
        if lookup.lost:
            self._abandon_ahead(job, _unanswered(lookup), now)
            return
        reply = lookup.result if lookup.ok else None
        ended_at = lookup.finished_at or now
        if reply is not None:
            job.tiers = known_tiers(list(reply.tiers)[:min(int(reply.num_hit), job.num_asked)])
            job.num_hit = len(job.tiers)
        loaded = reply is not None and reply.num_loaded is not None
        job.num_loaded = max(0, min(int(reply.num_loaded), job.num_hit)) if loaded else 0
        self.decider.load_ended(job, lookup.started_at, ended_at, job.num_loaded)
        if loaded and not job.aborted:
            job.to(State.LEASED)
            job.load = lookup
            job.to(State.LOADING)
            self.site.land(job, job.num_loaded)
            self._end(job, State.LANDED,
                      End.LANDED if job.num_loaded == job.num_hit else End.SHORT)
            return
        lease_id = reply.lease_id if reply is not None else None
        if job.aborted or reply is None or not job.tiers or not lease_id:
            if lease_id:
                self.client.release(lease_id)
            job.num_loaded = 0  # an aborted job's loaded blocks are nobody's
            # The daemon is done with the slots: it answered or the request never went out
            # (one that went out and got no reply was quarantined above).
            self.site.unreserve(job, quarantined=False)
            end = (End.ABORTED if job.aborted else End.LOOKUP_FAILED if reply is None
                   else End.MISS)
            self._end(job, State.GIVEN_UP, end)
            return
        job.lease_id = lease_id
        job.to(State.LEASED)
        end = None
        if job.lease_epoch != self.client.registration_epoch:
            end = End.RECONNECTED  # the lease died with its connection
        elif hung:
            self._release_lease_later(job)
            end = End.STORE_HUNG
        elif not self.decider.worth_loading(job):
            self._release_lease(job)
            end = End.DECLINED
        if end is not None:
            self.site.unreserve(job, quarantined=False)
            self._end(job, State.GIVEN_UP, end)
            return
        self._send_load(job, Slots(job.slots.block_ids[:job.num_hit], job.slots.memory))

    def _abandon_ahead(self, job: RestoreJob[Owner], end: RestoreEnd, now: float) -> None:
        """No reply to a ``lookup_load``: the daemon may still write its slots (quarantined
        until it answers) and hold a lease (released once it answers)."""
        assert job.slots is not None
        self.quarantine.hold(job.lookup, job.slots)
        self.client.disown(job.lookup)
        self.site.unreserve(job, quarantined=True)
        self.decider.load_ended(job, job.lookup.started_at, now, 0)
        self.counters["loads_given_up"] += 1
        self._end(job, State.GIVEN_UP, end)

    def _reserve_and_load(self, job: RestoreJob[Owner], now: float) -> None:
        """LEASED/WAITING_FOR_SLOTS -> LOADING, WAITING_FOR_SLOTS, or GIVEN_UP."""
        if job.lease_epoch != self.client.registration_epoch:
            self._end(job, State.GIVEN_UP, End.RECONNECTED)  # the lease died with its connection
            return
        # Not registered right now (a probe or a reconnect on its way): wait like for slots.
        got = self.site.reserve(job) if self.client.available else Reservation.WAIT
        if got is Reservation.REFUSE:
            self._release_lease(job)
            self._end(job, State.GIVEN_UP, End.REFUSED)
            return
        if got is Reservation.WAIT:
            if job.state is State.LEASED:
                job.to(State.WAITING_FOR_SLOTS)
                job.waiting_since = now
                self.counters["restores_waited_for_slots"] += 1
            assert job.waiting_since is not None
            if now - job.waiting_since >= self.settings.max_slot_wait_s:
                self._release_lease(job)
                self._end(job, State.GIVEN_UP, End.NO_SLOTS)
            return
        self._send_load(job, got)

    def _send_load(self, job: RestoreJob[Owner], slots: Slots) -> None:
        """LEASED/WAITING_FOR_SLOTS -> LOADING: the lease's blocks into ``slots``."""
        job.slots = slots
        assert job.lease_id is not None
        job.load = self.client.load(job.lease_id, slots.block_ids, self.settings.load_deadline_s,
                                    epoch=job.lease_epoch)
        self.decider.load_started(job)
        self.counters["loads"] += 1
        job.to(State.LOADING)

    def _take_load(self, job: RestoreJob[Owner], hung: bool, now: float) -> None:
        """LOADING -> LANDED (the daemon answered), or GIVEN_UP (hung, no reply)."""
        load = job.load
        assert load is not None and job.slots is not None
        if not load.poll():
            if hung:  # the owner recomputes now; the slots wait for the daemon's answer
                self._abandon_load(job, End.STORE_HUNG, now)
            return
        if load.lost:  # the daemon may still write the slots: quarantined
            self._abandon_load(job, _unanswered(load), now)
            return
        if not load.ok:
            self.counters["load_errors"] += 1
        job.num_loaded = max(0, min(int(load.result), job.num_hit)) if load.ok else 0
        self.decider.load_ended(job, load.started_at, load.finished_at or now, job.num_loaded)
        if job.aborted:
            self.site.unreserve(job, quarantined=False)
            self._end(job, State.GIVEN_UP, End.ABORTED)
            return
        self.site.land(job, job.num_loaded)
        self._end(job, State.LANDED,
                  End.LANDED if job.num_loaded == job.num_hit else End.SHORT)

    def _abandon_load(self, job: RestoreJob[Owner], end: RestoreEnd, now: float) -> None:
        assert job.load is not None and job.slots is not None
        self.quarantine.hold(job.load, job.slots)
        self.site.unreserve(job, quarantined=True)
        self.decider.load_ended(job, job.load.started_at, now, 0)
        self.counters["loads_given_up"] += 1
        self._end(job, State.GIVEN_UP, end)

    def _release_lease(self, job: RestoreJob[Owner]) -> None:
        """Give the lease back, if it still belongs to the client's connection."""
        if job.lease_id is not None and job.lease_epoch == self.client.registration_epoch:
            self.client.release(job.lease_id)

    def _release_lease_later(self, job: RestoreJob[Owner]) -> None:
        """Give the lease back once the store answers again (a release sent to a hung store
        would be dropped, and the lease would pin its blocks until its TTL)."""
        if job.lease_id is not None and job.lease_epoch == self.client.registration_epoch:
            self.client.disown(job.lookup)

    def _end(self, job: RestoreJob[Owner], state: RestoreState, end: RestoreEnd) -> None:
        job.to(state, end)
        self.counters[f"restores_{end.value}"] += 1
        self.counters["blocks_loaded"] += job.num_loaded

    # -- reading ------------------------------------------------------------------------------

    @property
    def jobs(self) -> list[RestoreJob[Owner]]:
        """The tracked jobs, oldest first (read-only use)."""
        return list(self._jobs)

    def num_in(self, state: RestoreState) -> int:
        return sum(1 for job in self._jobs if job.state is state)

    def wait_for_progress(self, timeout_s: float,
                          keep_waiting: Callable[[], bool] | None = None) -> None:
        """Nothing else to do: wait up to ``timeout_s`` until any tracked job's pending reply
        is in, in slices of ``PROGRESS_POLL_S``, and only while ``keep_waiting()`` (if given)."""
        pending = [transfer for job in self._jobs
                   if (transfer := job.load if job.state is State.LOADING else job.lookup)
                   is not None and not transfer.done]
        if not pending:
            return
        deadline = time.monotonic() + timeout_s
        while keep_waiting is None or keep_waiting():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if pending[0].wait(min(PROGRESS_POLL_S, left)) or any(t.poll() for t in pending[1:]):
                return
