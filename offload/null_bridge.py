"""The bridge of an engine without a store: every lookup a miss, every save dropped, counted.

Given to the engine when ``--kv-offload`` is off, so the scheduler and the step loop call one
interface whether or not a store is there (no optional bridge checked at every call).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from offload.bridge import RestoreBridge, StoreBridge
from offload.engine_view import OffloadSequence, RestoreOutcome


class NullRestores(RestoreBridge):
    """Nothing is ever restored: each sequence is checked once and admitted without a store."""

    def __init__(self, counters: Counter[str]) -> None:
        self.counters = counters
        self._hit_tokens: Counter[str] = Counter()

    @property
    def num_loading(self) -> int:
        return 0

    @property
    def num_waiting_for_blocks(self) -> int:
        return 0

    @property
    def first_waiting_for_blocks(self) -> OffloadSequence | None:
        return None

    @property
    def hit_tokens_by_tier(self) -> Counter[str]:
        return self._hit_tokens

    def prefetch(self, seq: OffloadSequence, busy: bool, may_restore: bool = False) -> bool:
        return False  # nothing to ask

    def forget(self, seq: OffloadSequence) -> None:
        pass

    def start_restore(self, seq: OffloadSequence, num_hbm_hit_blocks: int, busy: bool) -> bool:
        seq.offload_checked = True
        self.counters["lookups_without_store"] += 1
        return False

    def answered_lookups(self, seqs: list[OffloadSequence], keep_waiting: Callable[[], bool],
                         timeout_s: float) -> list[OffloadSequence]:
        return []  # no lookup is ever sent

    def poll(self) -> RestoreOutcome:
        return RestoreOutcome([], [])

    def abort(self, seq: OffloadSequence) -> bool:
        return False

    def wait_for_progress(self, timeout_s: float,
                          keep_waiting: Callable[[], bool] | None = None) -> None:
        pass  # nothing is in flight


class NullStore(StoreBridge):
    """No store: ``stats()`` is None (offload off), what was dropped is in ``counters``."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self._restores = NullRestores(self.counters)

    @property
    def restores(self) -> RestoreBridge:
        return self._restores

    @property
    def store_state(self) -> str | None:
        return None

    def save_computed(self, seqs: list[OffloadSequence],
                      work_done: Callable[[], bool] | None = None) -> None:
        self.counters["save_steps_without_store"] += 1

    def observe_step(self, num_prefill_tokens: int, seconds: float) -> None:
        pass  # no restore decision to feed

    def observe_first_token(self, kind: str, queued_s: float, prefill_s: float) -> None:
        pass  # no store whose cost to count

    def after_step(self) -> None:
        pass

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        pass

    def stats(self) -> dict | None:
        return None

    def close(self) -> None:
        pass
