"""kvengine's restore decision as the core's ``RestoreDecider``: load only what beats recompute.

The comparison is ``RestorePolicy``'s (bandwidth per tier against the step model); the loads
feed it bandwidth samples, one per busy period of the engine's loads (``LoadBusyPeriods``).
"""

from __future__ import annotations

from collections import Counter

from offload.core.decider import RestoreDecider
from offload.core.restore_job import RestoreJob
from offload.load_periods import LoadBusyPeriods
from offload.restore_policy import RestorePolicy

# After this many restores declined in a row, the next goes ahead (see worth_loading).
PROBE_EVERY = 16


class CostDecider(RestoreDecider):
    """``always``: load every hit (benchmarks measure a tier even where it loses)."""

    def __init__(self, policy: RestorePolicy, block_bytes: int, block_size: int,
                 counters: Counter[str], always: bool = False) -> None:
        self.policy = policy
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.counters = counters
        self.always = always
        self.load_bandwidth = LoadBusyPeriods()
        self._declined_in_a_row = 0

    def expected_load_s(self, job: RestoreJob) -> float:
        by_tier = Counter(job.tiers[:job.num_hit])
        return sum(self.policy.expected_load_s(t.value, n * self.block_bytes)
                   for t, n in by_tier.items())

    def fewest_worth_loading(self, tier: str, most: int) -> int:
        """The fewest blocks from ``tier`` whose load (its fixed cost included) beats
        recomputing them, for a request that waits for the store's reply anyway; ``most + 1``
        when no hit of up to ``most`` blocks does (``always``: 1)."""
        if self.always:
            return 1
        fixed_s = self.policy.expected_load_s(tier, 0)
        per_block_s = self.policy.expected_load_s(tier, self.block_bytes) - fixed_s
        gain_s = self.policy.expected_prefill_s(self.block_size) - per_block_s
        if gain_s <= 0:
            return most + 1
        return min(most + 1, int(fixed_s / gain_s) + 1)

    def worth_loading(self, job: RestoreJob) -> bool:
        if self.always:
            return True
        load_s, tokens = self.expected_load_s(job), job.num_hit * self.block_size
        if self.policy.restore_wins(load_s, tokens, job.busy):
            self._declined_in_a_row = 0
            return True
        self._declined_in_a_row += 1
        if self._declined_in_a_row >= PROBE_EVERY:
            # An estimate only a load can correct (one slow sample under contention would
            # otherwise decline that tier for good): one restore in PROBE_EVERY goes ahead.
            self._declined_in_a_row = 0
            self.counters["restores_probed"] += 1
            return True
        self.policy.note_declined(load_s, tokens, job.busy)
        return False

    def load_started(self, job: RestoreJob) -> None:
        self.load_bandwidth.started()

    def load_ended(self, job: RestoreJob, started_at: float, ended_at: float,
                   num_landed: int) -> None:
        landed = Counter(job.tiers[:num_landed])
        sample = self.load_bandwidth.ended(started_at, ended_at, {
            t.value: n * self.block_bytes for t, n in landed.items()})
        if sample is not None:
            self.policy.observe_load(*sample)
