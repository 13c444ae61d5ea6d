"""The named states of a restore and a save, their transitions, and how each one ends.

A restore: ``LOOKING_UP -> LEASED -> [WAITING_FOR_SLOTS ->] LOADING -> LANDED``, or ``GIVEN_UP``
from any state before ``LANDED``. A save: ``[WAITING_FOR_ROOM ->] PINNED -> SENT -> ENDED``, or
``DROPPED`` from any state before ``ENDED`` (never sent). The tables below are the only place
transitions are written down; ``RestoreJob.to`` and ``SaveJob.to`` refuse any other.
"""

from __future__ import annotations

import enum


class _Named(str, enum.Enum):
    """A state that travels as its string (stats, logs, counters)."""

    def __str__(self) -> str:
        return self.value


class RestoreState(_Named):
    LOOKING_UP = "looking_up"  # the lookup is out, no reply yet
    LEASED = "leased"  # a hit, leased; nothing reserved for it yet
    WAITING_FOR_SLOTS = "waiting_for_slots"  # leased; the site has no room yet (retried)
    LOADING = "loading"  # the load is out, into slots the site reserved
    LANDED = "landed"  # the daemon answered the load: its first ``num_loaded`` blocks arrived
    GIVEN_UP = "given_up"  # ended without a load answered; ``end`` says why


RESTORE_TRANSITIONS: dict[RestoreState, frozenset[RestoreState]] = {
    RestoreState.LOOKING_UP: frozenset({RestoreState.LEASED, RestoreState.GIVEN_UP}),
    RestoreState.LEASED: frozenset({RestoreState.WAITING_FOR_SLOTS, RestoreState.LOADING,
                                    RestoreState.GIVEN_UP}),
    RestoreState.WAITING_FOR_SLOTS: frozenset({RestoreState.LOADING, RestoreState.GIVEN_UP}),
    RestoreState.LOADING: frozenset({RestoreState.LANDED, RestoreState.GIVEN_UP}),
    RestoreState.LANDED: frozenset(),
    RestoreState.GIVEN_UP: frozenset(),
}


class RestoreEnd(_Named):
    """Why a restore ended: exactly one per restore, counted as ``restores_<value>``."""

    LANDED = "landed"  # every block asked for arrived
    SHORT = "short"  # the load answered with fewer blocks (an error reply: none)
    MISS = "miss"  # the store holds none of the blocks asked for
    LOOKUP_FAILED = "lookup_failed"  # the lookup got an error or no reply by its deadline
    LOOKUP_TIMEOUT = "lookup_timeout"  # no reply within the restorer's lookup wait
    DECLINED = "declined"  # the decider expects recomputing to be faster
    NO_SLOTS = "no_slots"  # no room for the hit within the slot wait
    REFUSED = "refused"  # the site will never take this hit (its prefix changed)
    RECONNECTED = "reconnected"  # the lease belonged to a connection since lost
    STORE_HUNG = "store_hung"  # the store stopped answering while the restore waited on it
    LOAD_TIMEOUT = "load_timeout"  # no reply to the load: its slots stay quarantined
    LOAD_LOST = "load_lost"  # its connection went before the reply: slots quarantined too
    ABORTED = "aborted"  # the engine dropped the request


class SaveState(_Named):
    WAITING_FOR_ROOM = "waiting_for_room"  # the site had no slots yet: pinned once it has
    PINNED = "pinned"  # the site holds the blocks (or a copy of them); not sent yet
    SENT = "sent"  # the save is out
    ENDED = "ended"  # answered, failed or timed out: per-block outcomes known
    DROPPED = "dropped"  # never reached the daemon (store unavailable, no room in time...)


SAVE_TRANSITIONS: dict[SaveState, frozenset[SaveState]] = {
    SaveState.WAITING_FOR_ROOM: frozenset({SaveState.PINNED, SaveState.DROPPED}),
    SaveState.PINNED: frozenset({SaveState.SENT, SaveState.DROPPED}),
    SaveState.SENT: frozenset({SaveState.ENDED, SaveState.DROPPED}),
    SaveState.ENDED: frozenset(),
    SaveState.DROPPED: frozenset(),
}


class SaveOutcome(_Named):
    """One block's save as the daemon reports it (the wire's strings)."""

    SAVED = "saved"
    DUPLICATE = "duplicate"  # the store already held it
    FAILED = "failed"

    @classmethod
    def parse(cls, value: object) -> SaveOutcome:
        """The daemon's outcome string; anything unknown counts as failed."""
        try:
            return cls(value)
        except ValueError:
            return cls.FAILED

    @property
    def stored(self) -> bool:
        return self is not SaveOutcome.FAILED


class IllegalTransition(RuntimeError):
    """A job was asked to move along an edge its state table does not have (a bug)."""
