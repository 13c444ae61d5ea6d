"""StepTiming: where one engine step spent its time."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepTiming:
    """Where one ``step`` spent its time: the previous step's deferred store work (``flush``),
    taking in new requests (``add``: lookups sent), scheduling (restores polled, lookup replies
    awaited), the forward and sampling (``execute``, device time included)."""

    flush_s: float
    add_s: float
    schedule_s: float
    execute_s: float
    total_s: float
    num_seqs: int
    num_tokens: int
    num_loading: int
