"""kvengine's restores: which sequences ask the store, when, and what a restore's end means.

The restore itself (lookup -> lease -> slots -> load -> landed, or given up) is the shared core's
(``offload.core.Restorer``) against kvengine's block ledger (``LedgerSite``) and cost-aware
decision (``CostDecider``). What is kvengine's own: a lookup sent when a request arrives, so the
reply is usually in when the scheduler reaches it; a bounded wait inside the step for replies
still on their way (a share of the previous step's time, larger for a likely hit: cheaper than
the step the request would lose; docs/measurements.md has the run that set it); and the
sequence's bookkeeping when a restore ends (restored tokens by tier, keys the store now holds,
ready or requeued).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from kvstore import Tier
from offload.bridge import RestoreBridge
from offload.core.restore_job import RestoreJob
from offload.core.restorer import Restorer
from offload.core.states import RestoreEnd, RestoreState
from offload.cost_decider import CostDecider
from offload.engine_view import OffloadSequence, RestoreOutcome
from offload.idents import sequence_idents
from offload.ledger_site import LedgerSite
from offload.restore_policy import RestorePolicy
from offload.saved_keys import SavedKeys
from offload.store_client import StoreClient
from offload.vocab import servable_blocks

# How long one step may wait in all for lookup replies of requests it admits: a share of the
# previous step's time (the next one's likely length), at least LOOKUP_WAIT_PER_STEP_S and at
# most the cap; a larger share for a likely hit (its first block is one this engine saved or
# restored), whose restore saves far more than the wait costs.
LOOKUP_WAIT_PER_STEP_S = 0.002
LOOKUP_WAIT_STEP_SHARE = 0.05
MAX_LOOKUP_WAIT_PER_STEP_S = 0.02
LIKELY_HIT_WAIT_STEP_SHARE = 0.25
MAX_LIKELY_HIT_WAIT_PER_STEP_S = 0.05
# A load expected to land within this share of the previous step's time (at least
# LANDING_WAIT_MIN_S, at most the cap) is waited for at the start of a step, so its sequence
# prefills in this step rather than the next: the running requests wait at most that share
# once, the restored one saves the rest of a step. Loads further off land while steps run.
LANDING_WAIT_MIN_S = 0.001
LANDING_WAIT_STEP_SHARE = 0.5
MAX_LANDING_WAIT_S = 0.01
# While the device runs a step, the step thread waits for lookup replies in slices this long,
# checking between them whether the device is done (then the step's tokens come first).
LOOKUP_POLL_S = 0.0002
# The least a restore costs (a round trip, maybe the bounded lookup wait): a lookup is sent only
# when recomputing its blocks is expected to take longer (and longer than a step, when busy).
MIN_RESTORE_S = 0.002


def lookup_wait_budget_s(last_step_s: float, likely_hit: bool = False) -> float:
    """How long one step may wait in all for lookup replies, given the previous step's time
    (a larger share for a likely hit)."""
    share, cap = ((LIKELY_HIT_WAIT_STEP_SHARE, MAX_LIKELY_HIT_WAIT_PER_STEP_S) if likely_hit
                  else (LOOKUP_WAIT_STEP_SHARE, MAX_LOOKUP_WAIT_PER_STEP_S))
    return max(LOOKUP_WAIT_PER_STEP_S, min(cap, share * last_step_s))


def landing_wait_budget_s(last_step_s: float, cap_s: float = MAX_LANDING_WAIT_S) -> float:
    """How long a step may wait in all for loads about to land, given the previous step's
    time (at most ``cap_s``)."""
    return max(LANDING_WAIT_MIN_S, min(cap_s, LANDING_WAIT_STEP_SHARE * last_step_s))


class EngineRestores(RestoreBridge):
    """kvengine's ``RestoreBridge`` over the shared restorer (step thread only)."""

    def __init__(self, client: StoreClient, site: LedgerSite, block_bytes: int,
                 policy: RestorePolicy, saved_keys: SavedKeys, counters: Counter[str],
                 always_restore: bool = False,
                 max_landing_wait_s: float = MAX_LANDING_WAIT_S) -> None:
        """``max_landing_wait_s``: the landing wait's cap (``landing_wait_budget_s``)."""
        self.client = client
        self.ledger = site.ledger
        self.block_size = site.block_size
        self.policy = policy
        self.saved_keys = saved_keys
        self.counters = counters
        self.always_restore = always_restore  # benchmarks: measure a tier even when it loses
        self.decider = CostDecider(policy, block_bytes, self.block_size, counters,
                                   always_restore)
        self.restorer: Restorer[OffloadSequence] = Restorer(
            client, site, self.decider, counters)  # RestoreSettings's defaults are kvengine's
        self._hit_tokens_by_tier: Counter[str] = Counter()
        self.restores: dict[str, RestoreJob[OffloadSequence]] = {}  # tracked, by request id
        self.prefetched: dict[str, RestoreJob[OffloadSequence]] = {}  # sent on arrival
        self._step_polled_at = 0.0  # lookup waits of this step count from here
        self.max_landing_wait_s = max_landing_wait_s

    @property
    def num_loading(self) -> int:
        return len(self.restores)

    @property
    def num_waiting_for_blocks(self) -> int:
        return self.restorer.num_in(RestoreState.WAITING_FOR_SLOTS)

    @property
    def first_waiting_for_blocks(self) -> OffloadSequence | None:
        waiting = [job.owner for job in self.restorer.jobs
                   if job.state is RestoreState.WAITING_FOR_SLOTS]
        return min(waiting, key=lambda seq: seq.arrival_time, default=None)

    @property
    def hit_tokens_by_tier(self) -> Counter[str]:
        return self._hit_tokens_by_tier

    def prefetch(self, seq: OffloadSequence, busy: bool, may_restore: bool = False) -> bool:
        """Send the lookup for the blocks past the HBM hit now; with ``may_restore`` and a
        likely hit, as a lookup the daemon loads at once into blocks reserved now (True: the
        bridge holds ``seq``). See ``RestoreBridge``."""
        if seq.request_id in self.prefetched or seq.request_id in self.restores:
            return False
        first = len(self.ledger.match_prefix(seq))
        if not self._worth_asking(seq, first, busy):
            return False
        hashes = seq.block_hashes[first:servable_blocks(seq.num_tokens, self.block_size)]
        idents = self._idents(seq, first)
        # A daemon older than ``lookup_load`` (protocol 1.4) is asked the two-step way.
        if (may_restore and self._likely_hit(seq, first)
                and self.client.daemon_knows("lookup_load")):
            ahead = self.restorer.look_up_and_load(
                seq, seq.namespace_digest, hashes, idents, first, busy,
                self.decider.fewest_worth_loading(Tier.DRAM.value, len(hashes)))
            if ahead is not None:
                self.restores[seq.request_id] = ahead
                self.counters["restores_ahead"] += 1
                return True
        self.prefetched[seq.request_id] = self.restorer.look_up(
            seq, seq.namespace_digest, hashes, idents, first, busy)
        self.counters["lookups_at_arrival"] += 1
        return False

    def _likely_hit(self, seq: OffloadSequence, first: int) -> bool:
        """The first block past the HBM hit is one this engine saved or restored."""
        hashes = seq.block_hashes
        return first < len(hashes) and hashes[first] in self.saved_keys

    def answered_lookups(self, seqs: list[OffloadSequence], keep_waiting: Callable[[], bool],
                         timeout_s: float) -> list[OffloadSequence]:
        """See ``RestoreBridge``: waits in slices of ``LOOKUP_POLL_S``."""
        jobs = [(seq, job) for seq in seqs
                if (job := self.prefetched.get(seq.request_id)) is not None]
        deadline = time.monotonic() + timeout_s
        for _, job in jobs:
            while not job.lookup.poll():
                left = deadline - time.monotonic()
                if left <= 0 or not keep_waiting():
                    break
                job.lookup.wait(min(LOOKUP_POLL_S, left))
        answered = [seq for seq, job in jobs if job.lookup.done]
        # what these checks found, not restores started: one still waiting counts again
        self.counters["lookups_answered_during_step"] += len(answered)
        return answered

    def forget(self, seq: OffloadSequence) -> None:
        job = self.prefetched.pop(seq.request_id, None)
        if job is not None:
            self.restorer.drop(job)

    def start_restore(self, seq: OffloadSequence, num_hbm_hit_blocks: int, busy: bool) -> bool:
        """Ask the store for the blocks past the HBM hit (or use the lookup sent on arrival);
        True if ``seq`` now waits on it, False if it goes on without the store."""
        job = self.prefetched.pop(seq.request_id, None)
        if job is not None and job.first_block != num_hbm_hit_blocks:  # the HBM hit moved
            self.restorer.drop(job)
            self.counters["lookups_at_arrival_stale"] += 1
            job = None
        if job is None:
            job = self._look_up(seq, num_hbm_hit_blocks, busy)
            if job is None:
                return False
        job.busy = busy
        if not job.lookup.poll():
            # Waiting (bounded per step) for a reply costs the running requests less than the
            # step the new one would otherwise lose. Loads and saves are never waited for.
            likely = self._likely_hit(seq, job.first_block)
            budget = (self._step_polled_at
                      + lookup_wait_budget_s(self.policy.last_step_s(), likely)
                      - time.monotonic())
            if budget <= 0 or not job.lookup.wait(budget):
                self.counters["lookups_answered_late"] += 1
                return self._start(job)  # the reply comes in a later step (poll)
            if likely:
                self.counters["lookups_waited_likely_hit"] += 1
        self.counters["lookups_answered_on_time"] += 1
        return self._start(job)

    def _start(self, job: RestoreJob[OffloadSequence]) -> bool:
        """True if the restore goes on (looking up, loading, waiting for blocks); False if it
        ended at once (a miss, declined, the store hung): admitted now, without the store."""
        if self.restorer.start(job):
            job.owner.offload_checked = True
            return False
        self.restores[job.owner.request_id] = job
        return True

    def _look_up(self, seq: OffloadSequence, first: int,
                 busy: bool) -> RestoreJob[OffloadSequence] | None:
        """Send the lookup of blocks ``first..`` (None: not worth asking, or no store)."""
        if not self._worth_asking(seq, first, busy):
            return None
        last = servable_blocks(seq.num_tokens, self.block_size)
        return self.restorer.look_up(seq, seq.namespace_digest, seq.block_hashes[first:last],
                                     self._idents(seq, first), first, busy)

    def _worth_asking(self, seq: OffloadSequence, first: int, busy: bool) -> bool:
        """Blocks past ``first`` to ask for, a store to ask, and a restore of them all that
        could beat recomputing them."""
        bs = self.block_size
        last = servable_blocks(seq.num_tokens, bs)
        if first >= last or not self.client.available:
            return False
        # Not worth a round trip when even an instant load of every block asked for would lose
        # to recomputing them (a lookup reply may also cost a bounded wait in the step).
        if not self.always_restore and not self.policy.restore_wins(
                MIN_RESTORE_S, (last - first) * bs, busy):
            self.counters["lookups_skipped_small"] += 1
            seq.offload_checked = True
            return False
        # A hit is a prefix: when the daemon's key filter lacks the first block asked for, no
        # tier holds it and the lookup would only say so, a round trip later.
        keys = self.client.key_filter
        if keys is not None and not keys.may_contain(seq.block_hashes[first]):
            self.counters["lookups_skipped_absent"] += 1
            seq.offload_checked = True
            return False
        return True

    def _idents(self, seq: OffloadSequence, first: int) -> list[bytes]:
        return sequence_idents(seq, range(first, servable_blocks(seq.num_tokens,
                                                                 self.block_size)),
                               self.block_size)

    def poll(self) -> RestoreOutcome:
        """Advance restores: the sequences whose load landed run now, those given up queue
        again (aborted ones are dropped)."""
        outcome = RestoreOutcome([], [])
        self._await_landings()
        self._step_polled_at = time.monotonic()
        for job in self.restorer.poll():
            seq = job.owner
            del self.restores[seq.request_id]
            seq.offload_checked = True
            if job.state is RestoreState.LANDED:
                self._landed(job)
                outcome.ready.append(seq)
            elif not seq.abort_requested:
                outcome.requeue.append(seq)
        return outcome

    def _await_landings(self) -> None:
        """Wait (bounded by ``landing_wait_budget_s``) for the loads expected to land inside
        that budget: their sequences run in the step being scheduled. A load that misses it
        lands during the step, as before."""
        if not self.restores:  # nothing tracked: every step but a restore's pays nothing
            return
        deadline = time.monotonic() + landing_wait_budget_s(self.policy.last_step_s(),
                                                            self.max_landing_wait_s)
        for job in self.restorer.jobs:
            if job.state is RestoreState.LOADING:
                load, expected_s = job.load, self.decider.expected_load_s(job)
            elif job.ahead and job.state is RestoreState.LOOKING_UP:  # its load rides along
                load, expected_s = job.lookup, self.policy.expected_load_s(
                    Tier.DRAM.value, job.num_asked * self.decider.block_bytes)
            else:
                continue
            if load is None or load.done or load.started_at + expected_s > deadline:
                continue
            self.counters["loads_awaited"] += 1
            if load.wait(max(0.0, deadline - time.monotonic())):
                self.counters["loads_awaited_landed"] += 1

    def _landed(self, job: RestoreJob[OffloadSequence]) -> None:
        """The sequence's restored prefix: tokens by tier, keys the store holds."""
        seq, n, bs = job.owner, job.num_loaded, self.block_size
        if job.end is RestoreEnd.SHORT:
            self.counters["loads_short"] += 1
        if job.load is not None and job.load.finished_at is not None:  # sent, landed, ready
            seq.restore_times = (job.lookup.started_at, job.load.finished_at, time.monotonic())
        self._count_stages(job)
        # The store's HBM tier is always another engine's arena (this engine's own blocks are
        # its prefix hit): usage calls those tokens hbm_peer, apart from its own hbm.
        restored = Counter((Tier.HBM_PEER if t is Tier.HBM else t).value for t in job.tiers[:n])
        seq.restored_tokens_by_tier = {tier: count * bs for tier, count in restored.items()}
        self._hit_tokens_by_tier.update(seq.restored_tokens_by_tier)
        # Loaded blocks are known to the store: never save them back.
        self.saved_keys.add(job.hashes[:n])
        seq.num_saved_blocks = job.first_block + n

    def _count_stages(self, job: RestoreJob[OffloadSequence]) -> None:
        """Where a landed restore's time went, summed in ms per stage (``restore_ms_*``): the
        lookup's round trip, its reply waiting for the load to be sent, the load, and the
        landing waiting for this poll; a restore ahead has ``lookup_load`` (one round trip) and
        ``landed_to_ready``. Landed restores are ``restores_landed`` plus ``restores_short``,
        ``restores_landed_ahead`` of them ahead (short ones included)."""
        lookup, load = job.lookup, job.load
        if load is None or lookup.finished_at is None or load.finished_at is None:
            return
        now = time.monotonic()
        stages = (("lookup", lookup.started_at, lookup.finished_at),
                  ("reply_to_load", lookup.finished_at, load.started_at),
                  ("load", load.started_at, load.finished_at),
                  ("landed_to_ready", load.finished_at, now))
        if load is lookup:  # restored ahead: one round trip, lookup and load together
            self.counters["restores_landed_ahead"] += 1
            stages = (("lookup_load", lookup.started_at, lookup.finished_at),
                      ("landed_to_ready", load.finished_at, now))
        for stage, start, end in stages:
            self.counters[f"restore_ms_{stage}"] += 1e3 * max(0.0, end - start)

    def abort(self, seq: OffloadSequence) -> bool:
        job = self.restores.get(seq.request_id)
        if job is None:
            return False
        seq.abort_requested = True
        if self.restorer.abort(job):
            return True  # its blocks are freed when the load ends
        del self.restores[seq.request_id]
        return False

    def wait_for_progress(self, timeout_s: float,
                          keep_waiting: Callable[[], bool] | None = None) -> None:
        self.restorer.wait_for_progress(timeout_s, keep_waiting)
