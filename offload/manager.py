"""The engine side of ``--kv-offload``: the ``StoreBridge`` built from its parts.

``Restorer`` (lookups and loads), ``Saver`` (write-through and evict hand-over) and
``ResidentPublisher`` (evictions, the HBM tier) share one connector, one ``SavedKeys`` and one
counter table; this facade sequences them per step as ``StoreBridge`` states. The step loop never
waits on the store.
"""

from __future__ import annotations

from collections import Counter

from offload.block_generations import BlockGenerations
from offload.bridge import StoreBridge
from offload.connector import OffloadConnector
from offload.engine_view import BlockLedger, OffloadSequence, RestoreOutcome
from offload.resident import ResidentPublisher
from offload.restore import Restorer
from offload.restore_policy import RestorePolicy
from offload.saved_keys import SavedKeys
from offload.saves import Saver

POLICIES = ("write-through", "evict")


class OffloadManager(StoreBridge):
    """Owns every in-flight store request of one engine; called by the scheduler and the engine."""

    def __init__(self, connector: OffloadConnector, ledger: BlockLedger, block_bytes: int,
                 policy: str, restore_policy: RestorePolicy, always_restore: bool = False,
                 generations: BlockGenerations | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown offload policy {policy!r}")
        self.connector = connector
        self.policy = policy
        self.restore_policy = restore_policy
        self.generations = generations
        self.counters: Counter[str] = Counter()
        # Bounded: a key dropped from here is at worst saved again ("duplicate").
        self.saved_keys = SavedKeys(4 * ledger.num_blocks)
        self.restorer = Restorer(connector, ledger, block_bytes, restore_policy,
                                 self.saved_keys, self.counters, always_restore)
        self.saver = Saver(connector, ledger, self.saved_keys, self.counters)
        self.publisher = ResidentPublisher(connector, ledger, generations, self.counters)
        ledger.enable_offload(track_released=policy == "evict", generations=generations)
        self._store_epoch = connector.registration_epoch  # the registration saved_keys is about
        self._closed = False

    # -- restore ----------------------------------------------------------------------------

    @property
    def num_loading(self) -> int:
        return len(self.restorer.restores)

    @property
    def num_waiting_for_blocks(self) -> int:
        return self.restorer.num_waiting_for_blocks

    @property
    def hit_tokens_by_tier(self) -> Counter[str]:
        return self.restorer.hit_tokens_by_tier

    @property
    def store_state(self) -> str:
        return self.connector.live_state

    def prefetch(self, seq: OffloadSequence, busy: bool) -> None:
        self.restorer.prefetch(seq, busy)

    def forget(self, seq: OffloadSequence) -> None:
        self.restorer.forget(seq)

    def start_restore(self, seq: OffloadSequence, num_hbm_hit_blocks: int, busy: bool) -> bool:
        return self.restorer.start_restore(seq, num_hbm_hit_blocks, busy)

    def poll(self) -> RestoreOutcome:
        return self.restorer.poll()

    def abort(self, seq: OffloadSequence) -> bool:
        return self.restorer.abort(seq)

    def wait_for_progress(self, timeout_s: float) -> None:
        self.restorer.wait_for_progress(timeout_s)

    # -- after a step -----------------------------------------------------------------------

    def save_computed(self, seqs: list[OffloadSequence]) -> None:
        self._check_store_epoch()
        if self.policy == "write-through":
            for seq in seqs:
                self.saver.save_new_blocks(seq)

    def observe_step(self, num_prefill_tokens: int, seconds: float) -> None:
        self.restore_policy.observe_step(num_prefill_tokens, seconds)

    def after_step(self) -> None:
        """Send the saves the step queued, finish saves that landed, hand over released blocks
        (``evict``), publish evictions and resident blocks. The engine runs this after the
        step's outputs went out (at the latest before the next step is scheduled), so none of
        it delays a token."""
        self.connector.keep_connected()
        self._check_store_epoch()
        if self.saver.queued:
            self.saver.send_queued()
        self.saver.poll()
        if self.policy == "evict":
            self.saver.hand_over_released()
        self.publisher.publish()

    def _check_store_epoch(self) -> None:
        """A new registration may be a restarted daemon that holds nothing we saved: forget
        what we believed it holds, so that every block is saved again (a "duplicate" reply
        costs little if it did keep them)."""
        epoch = self.connector.registration_epoch
        if epoch != self._store_epoch:
            if self._store_epoch:  # not the first registration: a reconnect
                self.saved_keys.clear()
                self.counters["store_resets"] += 1
            self._store_epoch = epoch

    # -- lifetime ---------------------------------------------------------------------------

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        self.saver.wait_idle(timeout_s)

    def close(self) -> None:
        """Let in-flight saves finish (bounded), then unregister from the store."""
        if self._closed:
            return
        self._closed = True
        self.wait_idle()
        self.connector.close()  # the daemon forgets this arena's resident blocks
        if self.generations is not None:
            self.generations.close()

    def stats(self) -> dict:
        # The state first: reading it counts a transition (store_hung...), which the copy of
        # the connector's counters below must include.
        state = self.connector.state
        out = dict(self.counters)
        out["connector"] = dict(self.connector.counters)
        out["restored_tokens_by_tier"] = dict(self.hit_tokens_by_tier)  # peer HBM included
        out["restore_policy"] = self.restore_policy.snapshot()
        out["num_loading"] = self.num_loading
        out["saves_in_flight"] = len(self.saver.in_flight)
        out["blocks_quarantined_now"] = self.restorer.quarantine.num_held
        out["store_state"] = state  # ok, hung or down
        return out
