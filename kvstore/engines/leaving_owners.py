"""LeavingOwners: connections that closed and whose registrations are still being dropped.

A connection's end is seen on the daemon's loop at once, but its registrations are dropped on a
worker after its copies in flight stopped. An engine that reconnects in that window (a restart,
a reconnect after a timeout) and registers its memory again would be refused: the memory is
still held by the registration of the connection it just closed. The registry marks an owner
leaving when its connection ends (``mark``) and gone once dropped (``gone``); a registration
refused over memory, a handle or an engine id while some owner is leaving waits for the leavers
(``wait``, bounded) and is tried once more. A leaving owner no longer counts against the cap on
connections that hold registrations: its connection is gone.
"""

from __future__ import annotations

import threading
import time

# The longest a refused registration waits for leaving owners' registrations to be dropped.
LEAVING_WAIT_S = 2.0


class LeavingOwners:
    """Thread-safe."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._leaving: set[str] = set()

    def mark(self, owner: str) -> None:
        with self._changed:
            self._leaving.add(owner)

    def __contains__(self, owner: str) -> bool:
        with self._changed:
            return owner in self._leaving

    def gone(self, owner: str) -> None:
        with self._changed:
            self._leaving.discard(owner)
            self._changed.notify_all()

    def wait(self, timeout_s: float = LEAVING_WAIT_S) -> bool:
        """True once no owner is leaving, if one was when called (a retry may now succeed);
        False at once when none was, or when ``timeout_s`` passed first."""
        give_up = time.monotonic() + timeout_s
        with self._changed:
            if not self._leaving:
                return False
            while self._leaving:
                left_s = give_up - time.monotonic()
                if left_s <= 0:
                    return False
                self._changed.wait(left_s)
            return True
