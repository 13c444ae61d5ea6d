"""One save: blocks the site holds for the store, sent, then ended with an outcome per block."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from offload.core.slots import Slots
from offload.core.states import SAVE_TRANSITIONS, IllegalTransition, SaveOutcome, SaveState
from offload.transfer import Transfer


@dataclass(eq=False)
class SaveJob:
    """``slots`` hold the blocks (pinned, or a copy) from PINNED until the job ends (None while
    WAITING_FOR_ROOM: the site had none for the owner's ``block_ids`` yet, and is asked again
    until ``room_deadline``, a ``time.monotonic()``); ``epoch`` is the link connection the slots
    were taken on (the save goes out on that one or not at all); ``outcomes`` are known once
    ENDED (all FAILED when no reply came)."""

    namespace: bytes
    hashes: list[bytes]
    idents: list[bytes]
    slots: Slots | None
    epoch: int
    state: SaveState = SaveState.PINNED
    call: Transfer | None = None
    outcomes: list[SaveOutcome] = field(default_factory=list)
    ready: Callable[[], bool] | None = None
    block_ids: list[int] = field(default_factory=list)
    room_deadline: float = 0.0

    @property
    def over(self) -> bool:
        return self.state in (SaveState.ENDED, SaveState.DROPPED)

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    @property
    def stored_hashes(self) -> list[bytes]:
        """The hashes the store holds now (saved, or already there)."""
        return [h for h, o in zip(self.hashes, self.outcomes) if o.stored]

    def to(self, state: SaveState) -> None:
        if state not in SAVE_TRANSITIONS[self.state]:
            raise IllegalTransition(f"save {self.state} -> {state}")
        self.state = state
