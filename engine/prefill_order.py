"""Which prefill gets the step's token budget first: shortest remaining first, with aging.

Decodes always go first (the scheduler does that); what is left of the budget goes to prefills.
Under ``shortest-first`` a sequence with little prompt left (a restored turn whose history came
from the store, an HBM hit, a short question) takes its chunk before a long cold prompt, which
takes what is left of the budget in the same step. No prompt starves: a sequence that has waited
``max_wait_steps`` steps for its next chunk is "aged" and goes before every non-aged one. Aged
running sequences go first (oldest wait first: they hold blocks, and only the waiting head or a
landed restore can join them), then an aged waiting head. So a running prompt waits at most
``max_wait_steps + 1`` steps for a chunk while it is the only aged one (``k`` aged ones: about
``k`` times that), whatever stream of short prompts arrives, and the waiting head waits at most
for the aged running prompts ahead of it. ``fcfs`` keeps the old order: running sequences in
admission order, then the waiting queue.

``latency_chunk_tokens`` (off by default) shortens the steps a first token waits for: while a
restore is in flight or some prefill can finish in this step, a prefill that cannot finish takes
at most that many tokens, so a restored turn's load lands during short steps and its own step is
not as long as a full chunk of someone else's long prompt (the long prompt still progresses every
step it is scheduled).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import PREFILL_ORDERS
from engine.sequence import Sequence


@dataclass(frozen=True)
class PrefillOrder:
    """Priority keys for prefill candidates (smaller goes first); plain data, no state."""

    policy: str = "shortest-first"
    max_wait_steps: int = 4
    latency_chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in PREFILL_ORDERS:
            raise ValueError(f"prefill order must be one of {PREFILL_ORDERS}, "
                             f"got {self.policy!r}")
        if not isinstance(self.max_wait_steps, int) or self.max_wait_steps < 0:
            raise ValueError(f"max_wait_steps must be a non-negative integer, "
                             f"got {self.max_wait_steps!r}")
        cap = self.latency_chunk_tokens
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0):
            raise ValueError(f"latency_chunk_tokens must be a positive integer or None, "
                             f"got {cap!r}")

    def chunk(self, num_remaining: int, budget: int, latency_bound: bool) -> int:
        """Tokens a prefill with ``num_remaining`` left gets from ``budget``: all it can, but
        at most ``latency_chunk_tokens`` in a latency-bound step unless it finishes now."""
        num_new = min(num_remaining, budget)
        cap = self.latency_chunk_tokens
        if latency_bound and cap is not None and num_new < num_remaining:
            num_new = min(num_new, cap)
        return num_new

    def is_aged(self, seq: Sequence, step: int) -> bool:
        """The sequence has waited its bound for a chunk: it goes before the others."""
        return step - seq.ready_since_step >= self.max_wait_steps

    def running_key(self, seq: Sequence, admission_index: int, step: int) -> tuple[int, int, int]:
        """The key of a running sequence with prompt left (``admission_index``: its place in
        the running list, the tie-breaker that keeps equal prompts in arrival order)."""
        if self.policy == "fcfs":
            return (2, 0, admission_index)
        if self.is_aged(seq, step):
            return (0, seq.ready_since_step, admission_index)
        return (2, seq.num_tokens - seq.num_computed_tokens, admission_index)

    def waiting_key(self, seq: Sequence, num_hit_tokens: int, step: int) -> tuple[int, int, int]:
        """The key of the waiting queue's head (admitted in arrival order, never overtaken by
        the waiting sequences behind it) after its HBM prefix hit. Between equals a running
        sequence goes first: it already holds blocks."""
        if self.policy == "fcfs":
            return (3, 0, 0)
        if self.is_aged(seq, step):
            return (1, seq.ready_since_step, 0)
        return (2, seq.num_tokens - num_hit_tokens, 1 << 62)
