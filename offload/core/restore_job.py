"""One restore: a chain of blocks looked up, leased, loaded into reserved slots, then landed.

Plain state moved only by the ``Restorer`` (step thread). Which fields mean something follows
from ``state``: ``lease_id``/``tiers``/``num_hit`` from LEASED on, ``slots``/``load`` in LOADING
and after, ``num_loaded`` once LANDED; ``end`` once LANDED or GIVEN_UP. A job restored
``ahead`` holds its ``slots`` from the start, and its ``lookup`` carries the load (a loaded reply
makes it its ``load`` too).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvstore import Tier
from offload.core.slots import Slots
from offload.core.states import RESTORE_TRANSITIONS, IllegalTransition, RestoreEnd, RestoreState
from offload.transfer import Transfer

Owner = TypeVar("Owner")


@dataclass(eq=False)
class RestoreJob(Generic[Owner]):
    """``owner`` is the engine's handle on the request (kvengine: its sequence; vLLM: the
    plan's block transfer); ``first_block`` is where the chain starts in the owner's blocks."""

    owner: Owner
    namespace: bytes
    hashes: list[bytes]
    idents: list[bytes]
    lookup: Transfer
    first_block: int = 0
    busy: bool = True  # other requests were running when it was asked for
    state: RestoreState = RestoreState.LOOKING_UP
    end: RestoreEnd | None = None
    lease_id: int | None = None
    tiers: list[Tier] = field(default_factory=list)
    num_hit: int = 0
    slots: Slots | None = None
    load: Transfer | None = None
    num_loaded: int = 0
    waiting_since: float | None = None  # when the site first said WAIT
    aborted: bool = False
    ahead: bool = False  # slots reserved before the lookup, which the daemon loads at once
    started_at: float = field(default_factory=time.monotonic)

    @property
    def num_asked(self) -> int:
        return len(self.hashes)

    @property
    def over(self) -> bool:
        return self.state in (RestoreState.LANDED, RestoreState.GIVEN_UP)

    @property
    def lease_epoch(self) -> int | None:
        """The link connection the lease belongs to (the one its lookup went out on)."""
        return self.lookup.sent_epoch

    def to(self, state: RestoreState, end: RestoreEnd | None = None) -> None:
        """Move along an edge of ``RESTORE_TRANSITIONS``; a final state needs its ``end``."""
        if state not in RESTORE_TRANSITIONS[self.state]:
            raise IllegalTransition(f"restore {self.state} -> {state}")
        if (end is not None) != (state in (RestoreState.LANDED, RestoreState.GIVEN_UP)):
            raise IllegalTransition(f"restore -> {state} with end {end}")
        self.state, self.end = state, end
