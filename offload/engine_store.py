"""kvengine's ``StoreBridge``: one store client and the parts that use it, once per step.

``EngineRestores`` (the scheduler's side), ``EngineSaves`` and ``ResidentPublisher`` share the
client, one ``LedgerSite`` (the block ledger as the core sees it), one ``SavedKeys`` and one
counter table; ``after_step`` runs the step's store work in order. The step loop never waits on
the store.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from offload.block_generations import BlockGenerations
from offload.bridge import StoreBridge
from offload.engine_view import BlockLedger, OffloadSequence
from offload.ledger_site import LedgerSite
from offload.offload_policy import OffloadPolicy
from offload.resident import ResidentPublisher
from offload.restore import MAX_LANDING_WAIT_S, EngineRestores
from offload.restore_policy import RestorePolicy
from offload.saved_keys import SavedKeys
from offload.saves import EngineSaves
from offload.store_client import StoreClient


class EngineStore(StoreBridge):
    """Owns every in-flight store request of one engine; called by the engine's step loop."""

    def __init__(self, client: StoreClient, ledger: BlockLedger, block_bytes: int,
                 policy: OffloadPolicy, restore_policy: RestorePolicy, always_restore: bool = False,
                 generations: BlockGenerations | None = None,
                 max_landing_wait_s: float = MAX_LANDING_WAIT_S) -> None:
        self.client = client
        self.policy = OffloadPolicy(policy)
        self.restore_policy = restore_policy
        self.generations = generations
        self.counters: Counter[str] = Counter()
        # Bounded: a key dropped from here is at worst saved again ("duplicate").
        self.saved_keys = SavedKeys(4 * ledger.num_blocks)
        site = LedgerSite(ledger, self.counters)
        self._restores = EngineRestores(client, site, block_bytes, restore_policy,
                                        self.saved_keys, self.counters, always_restore,
                                        max_landing_wait_s)
        self.saves = EngineSaves(client, site, self.saved_keys, self.counters)
        self.publisher = ResidentPublisher(client, ledger, generations, self.counters)
        ledger.enable_offload(track_released=self.policy is OffloadPolicy.EVICT,
                              generations=generations)
        self._store_epoch = client.registration_epoch  # the registration saved_keys is about
        self._closed = False
        # The last step's device work, while it may not have finished (see save_computed).
        self._work_done: Callable[[], bool] | None = None

    @property
    def restores(self) -> EngineRestores:
        return self._restores

    @property
    def store_state(self) -> str:
        return self.client.live_state.value

    def save_computed(self, seqs: list[OffloadSequence],
                      work_done: Callable[[], bool] | None = None) -> None:
        self._check_store_epoch()
        self._work_done = work_done
        if self.policy is OffloadPolicy.WRITE_THROUGH:
            for seq in seqs:
                self.saves.save_new_blocks(seq, work_done)

    def observe_step(self, num_prefill_tokens: int, seconds: float) -> None:
        self.restore_policy.observe_step(num_prefill_tokens, seconds)

    def observe_first_token(self, kind: str, queued_s: float, prefill_s: float) -> None:
        """Summed in ms by kind (``first_tokens_<kind>``, ``first_token_ms_queued_<kind>``,
        ``first_token_ms_prefill_<kind>``): against ``restore_ms_*``, where a restored
        request's time to its first token went beside an HBM hit's."""
        self.counters[f"first_tokens_{kind}"] += 1
        self.counters[f"first_token_ms_queued_{kind}"] += 1e3 * max(0.0, queued_s)
        self.counters[f"first_token_ms_prefill_{kind}"] += 1e3 * max(0.0, prefill_s)

    def after_step(self) -> None:
        """Send the saves the step pinned, finish saves that landed, hand over released
        blocks (``evict``), publish evictions and resident blocks. The engine runs this after
        the step's outputs went out (at the latest before the next step is scheduled), so none
        of it delays a token."""
        self.client.keep_connected()
        self._check_store_epoch()
        if self.policy is OffloadPolicy.EVICT:
            self.saves.hand_over_released(self._work_done)
        self.saves.send()  # those whose step's device work is done
        self.saves.poll()
        done = self._work_done
        if done is not None and not done():
            # Blocks the step registered may still be being written: their publication waits
            # (the ledger keeps them, and drops any evicted meanwhile). Evictions go now.
            self.publisher.publish_evictions()
            self.counters["resident_deferred"] += 1
            return
        self._work_done = None
        self.publisher.publish()

    def _check_store_epoch(self) -> None:
        """A new registration may be a restarted daemon that holds nothing we saved: forget
        what we believed it holds, so that every block is saved again (a "duplicate" reply
        costs little if it did keep them)."""
        epoch = self.client.registration_epoch
        if epoch != self._store_epoch:
            if self._store_epoch:  # not the first registration: a reconnect
                self.saved_keys.clear()
                self.counters["store_resets"] += 1
            self._store_epoch = epoch

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        self.saves.wait_idle(timeout_s)

    def close(self) -> None:
        """Let in-flight saves finish (bounded), then unregister from the store."""
        if self._closed:
            return
        self._closed = True
        self.wait_idle()
        self.client.close()  # the daemon forgets this arena's resident blocks
        if self.generations is not None:
            self.generations.close()

    def stats(self) -> dict:
        # The state first: reading it counts a transition (store_hung...), which the copy of
        # the client's counters below must include.
        state = self.client.state
        out = dict(self.counters)
        out["connector"] = dict(self.client.counters)
        out["restored_tokens_by_tier"] = dict(self._restores.hit_tokens_by_tier)
        out["restore_policy"] = self.restore_policy.snapshot()
        out["num_loading"] = self._restores.num_loading
        out["saves_in_flight"] = self.saves.num_in_flight
        out["blocks_quarantined_now"] = self._restores.restorer.quarantine.num_held
        out["store_state"] = state.value  # ok, hung or down
        return out

