"""The engine's two views of the store: what the scheduler calls and what the step loop calls.

The engine (``engine.scheduler``, ``engine.llm_engine``) holds a ``StoreBridge`` (given to it at
construction: ``offload.engine_store.EngineStore`` with ``--kv-offload``, else
``offload.null_bridge.NullStore``) and hands its ``restores`` to the scheduler; it sees nothing
else of ``offload``. Every method runs on the engine's step thread and returns without waiting on
the store (``wait_for_progress``, ``wait_idle`` and ``close`` wait, bounded, and say so).

The contract, in step order:

- ``restores.prefetch(seq, busy, may_restore)`` when a request arrives (``may_restore``: the
  scheduler would let a restore of it start now), ``restores.forget(seq)`` when it leaves
  before admission. True means the bridge restores it at once and holds it (LOADING), as after
  a ``start_restore`` that returned True.
- ``restores.poll()`` first in every ``schedule``: restores that landed (run them; their
  restored prefix is computed and registered) and restores given up (requeue them, to
  recompute). It may first wait, bounded by a share of the previous step, for loads about to
  land, so their sequences run in this step.
- ``restores.start_restore(seq, num_hbm_hit_blocks)`` for waiting sequences near the head of
  the queue (in arrival order, every step, whatever the step's token budget: a load costs none)
  whose ``seq.offload_checked`` is false: True means the bridge now holds it (the scheduler
  marks it LOADING and takes it off the queue until ``poll`` gives it back); False means admit it
  without the store. While a restore waits for blocks, nobody who arrived after its sequence
  (``first_waiting_for_blocks``) is admitted, and no other restore is started.
- While the device runs a step, ``restores.answered_lookups(seqs, ...)`` for the same waiting
  sequences (those that arrived during the step included), then ``start_restore`` for the
  answered ones: their loads cross the bus during the step, not after the next schedule.
- ``save_computed(seqs)`` after a forward, before finished sequences free their blocks;
  ``observe_step`` with the step's prefill tokens and seconds; ``observe_first_token`` once a
  sequence has its first token (where its time to it went, counted).
- ``after_step()`` once the step's outputs went out: saves are sent, evictions published.
- ``restores.abort(seq)`` for a LOADING sequence: True if its load is still in flight (the
  bridge frees its blocks when the load ends), False if the scheduler frees them itself.

A store that is down, slow or hung costs recompute (a smaller hit, a counted event), never an
exception or a stall of the step loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable

from offload.engine_view import OffloadSequence, RestoreOutcome


class RestoreBridge(ABC):
    """The scheduler's side: restores of waiting sequences from the store."""

    @property
    @abstractmethod
    def num_loading(self) -> int:
        """Sequences the bridge holds (LOADING: lookup or load in flight, or waiting for blocks)."""

    @property
    @abstractmethod
    def num_waiting_for_blocks(self) -> int:
        """Restores with a hit whose blocks could not be reserved yet."""

    @property
    @abstractmethod
    def first_waiting_for_blocks(self) -> OffloadSequence | None:
        """Of the sequences whose restore waits for blocks, the one that arrived first."""

    @property
    @abstractmethod
    def hit_tokens_by_tier(self) -> Counter[str]:
        """Tokens restored so far, by the tier they came from."""

    @abstractmethod
    def prefetch(self, seq: OffloadSequence, busy: bool, may_restore: bool = False) -> bool:
        """A request arrived (``busy``: others are running): maybe send its lookup now. With
        ``may_restore``, a likely hit may be restored at once (its blocks reserved now and
        loaded in the lookup's round trip): True, and the bridge holds ``seq``."""

    @abstractmethod
    def forget(self, seq: OffloadSequence) -> None:
        """The request left before admission: release what its prefetch holds."""

    @abstractmethod
    def start_restore(self, seq: OffloadSequence, num_hbm_hit_blocks: int, busy: bool) -> bool:
        """True if ``seq`` now waits on the store (LOADING), False to admit it without. Waits
        at most what is left of the step's budget for a lookup reply."""

    @abstractmethod
    def answered_lookups(self, seqs: list[OffloadSequence], keep_waiting: Callable[[], bool],
                         timeout_s: float) -> list[OffloadSequence]:
        """Those of ``seqs`` whose lookup sent on arrival (``prefetch``) has its reply, in the
        order given; for the others it waits while ``keep_waiting()`` (the device still runs the
        step: the step thread has nothing else to do) and at most ``timeout_s`` in all. A
        sequence without such a lookup is never among them (``start_restore`` would send one
        and wait)."""

    @abstractmethod
    def poll(self) -> RestoreOutcome:
        """Advance restores; restores a hung store holds are given up. Waits at most a share
        of the previous step's time, and only for loads expected to land within it."""

    @abstractmethod
    def abort(self, seq: OffloadSequence) -> bool:
        """Mark a LOADING sequence aborted; True if it is still in flight."""

    @abstractmethod
    def wait_for_progress(self, timeout_s: float,
                          keep_waiting: Callable[[], bool] | None = None) -> None:
        """Nothing runs but restores: wait at most ``timeout_s`` for a reply to any of them,
        and (with ``keep_waiting``) only while ``keep_waiting()``, checked between short slices:
        a request or an abort that arrives meanwhile ends the wait, so it never waits for
        another request's restore."""


class StoreBridge(ABC):
    """The step loop's side: saves, published evictions, the store's health, lifetime."""

    @property
    @abstractmethod
    def restores(self) -> RestoreBridge:
        """What the scheduler calls (the same object for the bridge's life)."""

    @property
    @abstractmethod
    def store_state(self) -> str | None:
        """``ok``, ``hung`` or ``down``, as of now (None: no store); any thread."""

    @abstractmethod
    def save_computed(self, seqs: list[OffloadSequence],
                      work_done: Callable[[], bool] | None = None) -> None:
        """The step's sequences computed new tokens: pin the new full blocks to save.
        ``work_done``: whether the step's device work has finished (None: it has, the step
        read its sampled tokens). No block the step wrote is sent to the store or published as
        resident before: the daemon copies on its own stream, in another process."""

    @abstractmethod
    def observe_step(self, num_prefill_tokens: int, seconds: float) -> None:
        """Feed the restore decision a timed step."""

    @abstractmethod
    def observe_first_token(self, kind: str, queued_s: float, prefill_s: float) -> None:
        """A sequence's first token: ``queued_s`` from its arrival to its first step (a
        restore's lookup and load included), ``prefill_s`` from then to the token; ``kind``:
        ``restored`` (part of its prefix came from the store), ``hbm_hit`` or ``cold``."""

    @abstractmethod
    def after_step(self) -> None:
        """Send queued saves, finish landed ones, publish evictions and resident blocks."""

    @abstractmethod
    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Wait (bounded) until in-flight saves ended: shutdown, tests, benchmarks."""

    @abstractmethod
    def stats(self) -> dict | None:
        """Counters for ``/metrics`` and ``stats()`` (plain data, safe to copy); None without
        a store."""

    @abstractmethod
    def close(self) -> None:
        """Let saves finish (bounded), unregister from the store. Idempotent."""
