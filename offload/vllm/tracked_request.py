"""One request the vLLM scheduler side follows, and where its load from the store stands.

A request's load: ``IDLE -> HIT -> LOADING -> IDLE``. ``HIT`` is a lookup's answer waiting for
vLLM to reserve blocks for it (``update_state_after_alloc``); asked again, or a cache reset,
decides it afresh (``HIT -> IDLE``). ``LOADING`` holds the load budget until the workers report
the load finished. The table below is the only place transitions are written down;
``TrackedRequest.to`` refuses any other (vLLM never asks about a request whose load is in
flight: the request waits for it, out of the schedule, until the load is reported finished).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from offload.core.states import IllegalTransition


class LoadState(str, enum.Enum):
    """Where a tracked request's load stands; travels as its string."""

    IDLE = "idle"  # no hit waiting, no load in flight: a miss, a producer, a load that ended
    HIT = "hit"  # the last lookup found blocks past vLLM's prefix; none reserved for them yet
    LOADING = "loading"  # the load is planned or in flight; its blocks hold the load budget

    def __str__(self) -> str:
        return self.value


LOAD_TRANSITIONS: dict[LoadState, frozenset[LoadState]] = {
    LoadState.IDLE: frozenset({LoadState.HIT}),
    LoadState.HIT: frozenset({LoadState.IDLE, LoadState.LOADING}),
    LoadState.LOADING: frozenset({LoadState.IDLE}),
}


@dataclass(eq=False)
class TrackedRequest:
    """A request's tokens, its vLLM blocks, what of it is stored, and its load. Which load
    fields mean something follows from ``state``: ``first_block`` in HIT and LOADING,
    ``num_hit_blocks`` in HIT, ``load_ids`` and ``load_ok_blocks`` in LOADING."""

    token_ids: Sequence[int]  # vLLM's live list: it grows as tokens are sampled
    cache_salt: str | None
    lora_id: str | None
    block_ids: list[int] = field(default_factory=list)
    num_stored_blocks: int = 0  # blocks [0, this) are in the store (hit, loaded or saved)
    state: LoadState = LoadState.IDLE
    first_block: int = 0  # the hit's (and then the load's) first block index in the request
    num_hit_blocks: int = 0  # blocks the store holds from ``first_block`` on
    hit_tiers: list[str] = field(default_factory=list)  # each hit block's tier (last match)
    load_ids: list[int] = field(default_factory=list)  # the load's vLLM block ids
    load_ok_blocks: int = 0  # the load's blocks before the first one a worker reported failed
    # vLLM's own hashes of the request's blocks (its live list), for the KV events; None or
    # short: the store's hashes name the blocks instead.
    block_hashes: Sequence[bytes] | None = None
    lora_name: str | None = None

    @property
    def num_loading_blocks(self) -> int:
        """The blocks of the load in flight: what the request holds of the load budget."""
        return len(self.load_ids) if self.state is LoadState.LOADING else 0

    def to(self, state: LoadState) -> None:
        """Move along an edge of ``LOAD_TRANSITIONS``."""
        if state not in LOAD_TRANSITIONS[self.state]:
            raise IllegalTransition(f"vLLM request load {self.state} -> {state}")
        self.state = state
