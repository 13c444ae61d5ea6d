"""Restores: find a sequence's prefix in the store and load it into blocks reserved for it.

Per sequence: on arrival an async lookup for the blocks past the HBM prefix hit, so that the reply
is usually in when the scheduler reaches it (a step waits a bounded time in all, a share of the
previous step's length, for replies still on their way: cheaper than the step the request would
lose); on a hit worth restoring
(``RestorePolicy``) the blocks are reserved and an async load started; the sequence waits in
LOADING while others run; when the load lands, its blocks join the prefix cache and prefill covers
only the rest. A short or failed load shrinks the hit to what arrived.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from offload.connector import OffloadConnector
from offload.engine_view import BlockLedger, OffloadSequence, RestoreOutcome
from offload.idents import sequence_idents
from offload.load_periods import LoadBusyPeriods
from offload.quarantine import Quarantine
from offload.restore_policy import RestorePolicy
from offload.saved_keys import SavedKeys
from offload.transfer import Transfer

# A restore whose blocks cannot be reserved yet keeps its lease and retries every step for this
# long (well inside the lease's TTL), then gives up and recomputes.
MAX_BLOCK_WAIT_S = 5.0
# How long one step may wait in all for lookup replies of requests it admits: a share of the
# previous step's time (the next one's likely length), at least LOOKUP_WAIT_PER_STEP_S and at
# most the cap. A reply that misses it makes its request wait for the next step boundary, a
# whole step: on an H100 long-context run (19k-token histories, 2,048-token chunks) 35 of 45
# lookups missed a flat 2 ms and their restores sat out steps of hundreds of ms. A likely hit
# (the first block asked for is one this engine saved or restored) is worth a larger share:
# missing the step costs it all of the step, and its restore saves far more. Requests admitted
# without the store lose only the step.
LOOKUP_WAIT_PER_STEP_S = 0.002
LOOKUP_WAIT_STEP_SHARE = 0.05
MAX_LOOKUP_WAIT_PER_STEP_S = 0.02
LIKELY_HIT_WAIT_STEP_SHARE = 0.25
MAX_LIKELY_HIT_WAIT_PER_STEP_S = 0.05
# A request waits for a lookup reply at most this long (the store answers in well under a
# millisecond; a hung store is given up sooner, as soon as its probe is overdue), then recomputes.
MAX_LOOKUP_WAIT_S = 1.5
# The least a restore costs (a round trip, maybe the bounded lookup wait): a lookup is sent only
# when recomputing its blocks is expected to take longer (and longer than a step, when busy).
MIN_RESTORE_S = 0.002


def lookup_wait_budget_s(last_step_s: float, likely_hit: bool = False) -> float:
    """How long one step may wait in all for lookup replies, given the previous step's time
    (a larger share for a likely hit)."""
    share, cap = ((LIKELY_HIT_WAIT_STEP_SHARE, MAX_LIKELY_HIT_WAIT_PER_STEP_S) if likely_hit
                  else (LOOKUP_WAIT_STEP_SHARE, MAX_LOOKUP_WAIT_PER_STEP_S))
    return max(LOOKUP_WAIT_PER_STEP_S, min(cap, share * last_step_s))


@dataclass
class Restore:
    """One sequence's restore in flight: the lookup, then (maybe) the load."""

    seq: OffloadSequence
    first_block: int  # blocks before this were HBM hits
    lookup: Transfer
    load: Transfer | None = None
    tiers: list[str] = field(default_factory=list)
    num_blocks: int = 0  # blocks the load asked for
    lease_id: int | None = None
    num_hit: int = 0  # blocks the lookup found (0 until it answered)
    waiting_since: float | None = None  # when a reservation first failed for lack of blocks
    busy: bool = True  # other requests were running when it asked (a restore sits out a step)


class Restorer:
    """Owns every restore in flight of one engine (step thread only)."""

    def __init__(self, connector: OffloadConnector, ledger: BlockLedger, block_bytes: int,
                 policy: RestorePolicy, saved_keys: SavedKeys, counters: Counter[str],
                 always_restore: bool = False) -> None:
        self.connector = connector
        self.ledger = ledger
        self.block_size = ledger.block_size
        self.block_bytes = block_bytes
        self.policy = policy
        self.saved_keys = saved_keys
        self.counters = counters
        self.always_restore = always_restore  # benchmarks: measure a tier even when it loses
        self.hit_tokens_by_tier: Counter[str] = Counter()
        self.restores: dict[str, Restore] = {}
        self.prefetched: dict[str, Restore] = {}  # lookups sent on arrival, not yet used
        self._step_polled_at = 0.0  # lookup waits of this step count from here
        self.load_bandwidth = LoadBusyPeriods()  # bandwidth samples (see there)
        self.quarantine = Quarantine(ledger, counters)

    @property
    def num_waiting_for_blocks(self) -> int:
        return sum(1 for r in self.restores.values()
                   if r.load is None and r.waiting_since is not None)

    def prefetch(self, seq: OffloadSequence, busy: bool) -> None:
        """Send the lookup for the blocks past the HBM hit now (see ``StoreBridge``)."""
        if seq.request_id in self.prefetched or seq.request_id in self.restores:
            return
        r = self._lookup(seq, len(self.ledger.match_prefix(seq)), busy)
        if r is not None:
            self.prefetched[seq.request_id] = r
            self.counters["lookups_at_arrival"] += 1

    def forget(self, seq: OffloadSequence) -> None:
        r = self.prefetched.pop(seq.request_id, None)
        if r is not None:
            self.connector.disown(r.lookup)

    def start_restore(self, seq: OffloadSequence, num_hbm_hit_blocks: int, busy: bool) -> bool:
        """Ask the store for the blocks past the HBM hit (or use the lookup sent on arrival);
        True if ``seq`` now waits on it, False if it goes on without the store."""
        r = self.prefetched.pop(seq.request_id, None)
        if r is not None and r.first_block != num_hbm_hit_blocks:  # the HBM hit moved since
            self.connector.disown(r.lookup)
            self.counters["lookups_at_arrival_stale"] += 1
            r = None
        if r is None:
            r = self._lookup(seq, num_hbm_hit_blocks, busy)
            if r is None:
                return False
        r.busy = busy
        self.restores[seq.request_id] = r
        if not r.lookup.poll():
            # A lookup reply takes about a millisecond (more while the daemon is busy saving);
            # waiting for it (bounded per step, see LOOKUP_WAIT_*) costs the running requests
            # less than the step the new one would otherwise lose. Loads and saves are never
            # waited for.
            hashes = r.seq.block_hashes
            likely = r.first_block < len(hashes) and hashes[r.first_block] in self.saved_keys
            budget = (self._step_polled_at
                      + lookup_wait_budget_s(self.policy.last_step_s(), likely)
                      - time.monotonic())
            if budget <= 0 or not r.lookup.wait(budget):
                self.counters["lookups_answered_late"] += 1
                return True  # the reply comes in a later step (poll)
            if likely:
                self.counters["lookups_waited_likely_hit"] += 1
        self.counters["lookups_answered_on_time"] += 1
        if self._begin_load(r):
            return True  # loading, or waiting for blocks
        del self.restores[seq.request_id]
        return False  # a miss or declined: admitted now, without the store

    def _lookup(self, seq: OffloadSequence, first: int, busy: bool) -> Restore | None:
        """Send the lookup of blocks ``first..`` (None: not worth asking, or no store)."""
        bs = self.block_size
        last = (seq.num_tokens - 1) // bs  # leave at least one token to compute
        if first >= last or not self.connector.available:
            return None
        # Not worth a round trip when even an instant load of every block asked for would lose
        # to recomputing them (a lookup reply may also cost a bounded wait in the step).
        if not self.always_restore and not self.policy.restore_wins(
                MIN_RESTORE_S, (last - first) * bs, busy):
            self.counters["lookups_skipped_small"] += 1
            seq.offload_checked = True
            return None
        hashes = seq.block_hashes[first:last]
        idents = sequence_idents(seq, range(first, last), bs)
        lookup = self.connector.lookup(seq.namespace_digest, hashes, idents)
        self.counters["lookups"] += 1
        return Restore(seq, first, lookup)

    def poll(self) -> RestoreOutcome:
        """Advance restores. Sequences aborted meanwhile are dropped here once nothing of
        theirs is in flight; a hung store's restores are given up (recomputed)."""
        outcome = RestoreOutcome([], [])
        now = time.monotonic()
        self._step_polled_at = now
        self.connector.release_disowned()
        self.quarantine.poll()
        hung = bool(self.restores) and self.connector.state == "hung"
        for request_id, r in list(self.restores.items()):
            if r.load is None:
                if not r.lookup.poll():
                    if hung or now - r.lookup.started_at > MAX_LOOKUP_WAIT_S:
                        self._give_up(request_id, r, outcome)
                    continue
                if r.seq.abort_requested:
                    del self.restores[request_id]
                    if r.lookup.ok and r.lookup.result is not None and r.lookup.result.lease_id:
                        self.connector.release(r.lookup.result.lease_id)
                    continue
                if self._reserve_and_load(r) if r.num_hit else self._begin_load(r):
                    continue
                del self.restores[request_id]
                outcome.requeue.append(r.seq)
            elif r.load.poll():
                del self.restores[request_id]
                landed = self._finish_load(r)
                if r.seq.abort_requested:
                    self.ledger.free(r.seq)
                else:
                    (outcome.ready if landed else outcome.requeue).append(r.seq)
            elif hung:
                self._give_up(request_id, r, outcome)
        return outcome

    def _give_up(self, request_id: str, r: Restore, outcome: RestoreOutcome) -> None:
        """Stop waiting for the store: the sequence recomputes. A lookup's reply (and lease)
        is released when it comes; a load's blocks stay quarantined until it is answered."""
        del self.restores[request_id]
        seq = r.seq
        seq.offload_checked = True
        if r.load is None:
            self.connector.disown(r.lookup)
            self.counters["lookups_given_up"] += 1
        else:
            self.quarantine.hold(r.load, seq.block_ids[r.first_block:r.first_block + r.num_blocks])
            self.load_bandwidth.ended(r.load.started_at, time.monotonic(), {})  # lands nothing
            self.counters["loads_given_up"] += 1
            self.ledger.free(seq)
            seq.num_computed_tokens = 0
        if not seq.abort_requested:
            outcome.requeue.append(seq)

    def _begin_load(self, r: Restore) -> bool:
        reply = r.lookup.result if r.lookup.ok else None
        r.seq.offload_checked = True
        if reply is None or reply.num_hit == 0:
            self.counters["lookup_misses"] += 1
            return False
        r.lease_id, r.tiers = reply.lease_id, list(reply.tiers)
        num_hit = reply.num_hit
        tokens = num_hit * self.block_size
        load_s = self._expected_load_s(r.tiers)
        if not self.always_restore and not self.policy.restore_wins(load_s, tokens, r.busy):
            self.counters["restores_declined"] += 1  # recomputing is expected to be faster
            self.policy.note_declined(load_s, tokens, r.busy)
            self._release(r)
            return False
        r.num_hit = num_hit
        return self._reserve_and_load(r)

    def _reserve_and_load(self, r: Restore) -> bool:
        """Reserve blocks for the hit and start the load; without free blocks keep the lease
        and stay LOADING (retried next step) until ``MAX_BLOCK_WAIT_S``. False: give up."""
        seq, num_hit = r.seq, r.num_hit
        # The HBM prefix may have changed since the lookup was sent: restore only onto the
        # exact prefix it was asked for.
        hbm_hits = self.ledger.match_prefix(seq)
        if len(hbm_hits) != r.first_block:
            self.counters["restores_prefix_changed"] += 1
            self._release(r)
            return False
        if not self.ledger.admit(seq, hbm_hits, num_hit * self.block_size):
            now = time.monotonic()
            if r.waiting_since is None:
                r.waiting_since = now
                self.counters["restores_waited_for_blocks"] += 1
            if now - r.waiting_since < MAX_BLOCK_WAIT_S:
                return True
            self.counters["restores_no_blocks"] += 1
            self._release(r)
            seq.block_ids, seq.num_computed_tokens = [], 0
            return False
        r.num_blocks = num_hit
        dst = seq.block_ids[r.first_block:r.first_block + num_hit]
        r.load = self.connector.load(r.lease_id, dst)
        self.load_bandwidth.started()
        self.counters["loads"] += 1
        return True

    def _expected_load_s(self, tiers: list[str]) -> float:
        by_tier = Counter(tiers)
        return sum(self.policy.expected_load_s(t, n * self.block_bytes)
                   for t, n in by_tier.items())

    def _finish_load(self, r: Restore) -> bool:
        """Account a landed load; True if the sequence runs now on its restored prefix."""
        seq = r.seq
        assert r.load is not None
        dst = seq.block_ids[r.first_block:r.first_block + r.num_blocks]
        if r.load.timed_out:
            # No reply: the daemon may still write into these blocks. Keep them out of use for
            # good (counted) and start the sequence over on fresh blocks.
            self.quarantine.hold(r.load, dst)
            self.load_bandwidth.ended(r.load.started_at, time.monotonic(), {})
            self.ledger.free(seq)
            seq.num_computed_tokens = 0
            return False
        num_loaded = 0
        try:
            num_loaded = max(0, min(int(r.load.result) if r.load.ok else 0, r.num_blocks))
        finally:  # every started load ends once, whatever its reply held
            landed_at = r.load.finished_at or time.monotonic()  # set: the load is done
            landed = Counter(r.tiers[:num_loaded])
            sample = self.load_bandwidth.ended(r.load.started_at, landed_at, {
                t: n * self.block_bytes for t, n in landed.items()})
        if sample is not None:
            self.policy.observe_load(*sample)
        if num_loaded < r.num_blocks:
            self.counters["loads_short"] += 1
        bs = self.block_size
        seq.num_computed_tokens = (r.first_block + num_loaded) * bs
        restored = Counter(r.tiers[:num_loaded])
        seq.restored_tokens_by_tier = {tier: n * bs for tier, n in restored.items()}
        for tier, tokens in seq.restored_tokens_by_tier.items():
            self.hit_tokens_by_tier[tier] += tokens
        self.counters["blocks_loaded"] += num_loaded
        # Loaded blocks are known to the store: never save them back.
        self.saved_keys.add(seq.block_hashes[r.first_block:r.first_block + num_loaded])
        seq.num_saved_blocks = r.first_block + num_loaded
        if seq.abort_requested:
            return False
        self.ledger.register_computed_blocks(seq)
        return True

    def _release(self, r: Restore) -> None:
        if r.lease_id is not None:
            self.connector.release(r.lease_id)

    def wait_for_progress(self, timeout_s: float) -> None:
        """Nothing to run but restores in flight: wait up to ``timeout_s`` for a store reply."""
        for r in self.restores.values():
            transfer = r.load or r.lookup
            if not transfer.done:
                transfer.wait(timeout_s)
                return

    def abort(self, seq: OffloadSequence) -> bool:
        if seq.request_id in self.restores:
            seq.abort_requested = True
            return True
        return False
