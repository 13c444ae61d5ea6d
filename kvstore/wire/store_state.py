"""StoreState: the daemon's health as a client sees it, and the two rules that tell it.

Every part that must never wait on the daemon names its state with this one enum: the engine's
link thread (``offload/link_thread.py``: OK, HUNG or DOWN, read by kvengine, vLLM's connector
and the engine's ``store_state`` stats) and the router's locator (``server/router/kv_locator.py``,
which also says UNKNOWN before its first ask and REFUSED for a daemon that answers ``locate``
with an error). What makes the daemon hung rather than down is decided here, once:

- ``while_waiting`` (requests still out): HUNG while a wait on the daemon has run past the
  deadline with no reply of any kind heard since it began (alive enough to hold the socket,
  yet silent, as under SIGSTOP; a daemon that still answers other requests is slow, not hung);
  else DOWN without an open connection; else OK.
- ``after_failure`` (a request that ended without its answer): no reply in time is HUNG, an
  error reply REFUSED, a connection that failed or was never made DOWN.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvstore.wire.replies import ClientError

if TYPE_CHECKING:
    from kvstore.wire.client import Client


class StoreState(str, enum.Enum):
    """The daemon as one client sees it now; the values travel in stats and metric labels."""

    UNKNOWN = "unknown"  # not asked yet
    OK = "ok"
    DOWN = "down"  # not connected, or the connection failed
    HUNG = "hung"  # no answer within the bound, nothing else heard meanwhile
    REFUSED = "refused"  # it answered an error (say, a daemon too old for the verb)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def while_waiting(cls, client: Client | None, waits: Iterable[float | None],
                      deadline_s: float, connected: bool = True) -> StoreState:
        """The state while requests may be out: ``waits`` are when each wait on the daemon
        began (``time.monotonic()``; None: no wait). HUNG once one has lasted past
        ``deadline_s`` with no reply of any kind heard since it began, unless an answer
        waits unread in the socket (this process, not the daemon, was held up); DOWN without
        ``client``, with its connection closed, or not ``connected`` (the caller's own
        condition, a registration); else OK. Never blocks: it reads timestamps (and peeks), so
        it is right even while the waiting thread is stuck."""
        now = time.monotonic()
        heard = client.last_reply_at if client is not None else 0.0
        for since in waits:
            if since is not None and now - max(since, heard) > deadline_s:
                # The peek lets go of the GIL: a reader held up until now may read meanwhile,
                # so what it heard is read again after it.
                if client is not None and (client.answer_waiting()
                                           or now - max(since, client.last_reply_at)
                                           <= deadline_s):
                    break
                return cls.HUNG
        if client is None or client.is_closed or not connected:
            return cls.DOWN
        return cls.OK

    @classmethod
    def after_failure(cls, exc: BaseException) -> StoreState:
        """What a request that ended with ``exc`` instead of its answer says about the daemon:
        a ``TimeoutError`` (the client's ``RequestTimeout``, or the caller's own bound) HUNG;
        an error reply (``ClientError``) REFUSED; anything else (``DaemonUnavailable``,
        ``OSError``: the connection) DOWN."""
        if isinstance(exc, TimeoutError):
            return cls.HUNG
        if isinstance(exc, ClientError):
            return cls.REFUSED
        return cls.DOWN
