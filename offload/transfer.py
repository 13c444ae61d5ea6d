"""One store request as the step loop sees it: a handle that is polled, never waited on long.

A request is queued for the link thread (``LinkThread``), which sends it (``attach``) or gives it up
(``abandon``: not connected, queue closed). Either way the handle completes exactly once:
with the daemon's reply (``ok``), with an error reply, or with the caller's fallback when the
daemon is gone or the deadline passed. ``answered`` says whether the daemon replied at all: after
a reply it no longer touches the blocks the request named.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from kvstore import ClientError, DaemonUnavailable, PeerProcess, Pending


class Transfer:
    """``poll()`` is non-blocking; ``result`` is set once it is done.

    A request that fails (daemon gone, error reply, past its deadline) completes with
    ``ok=False`` and ``result`` the fallback the caller gave (a miss, zero blocks loaded...).
    """

    def __init__(self, deadline_s: float, fallback: Any,
                 on_error: Callable[[str], None], queued: bool = True) -> None:
        self.started_at = time.monotonic()
        self._deadline = self.started_at + deadline_s
        self._fallback = fallback
        self._on_error = on_error
        # Set by the link's thread: the request went out (``_pending``) or never will.
        self._pending: Pending | None = None
        self._abandoned = not queued
        self._handled = threading.Event()
        self.finished_at: float | None = None
        self.done = not queued
        self.ok = False
        self.answered = False  # the daemon replied (ok or an error reply)
        self.timed_out = False  # no reply at all: the daemon may still touch the blocks
        self.sent_epoch: int | None = None  # the link's connection it went out on
        self.sent_to: PeerProcess | None = None  # the daemon's process on that connection
        self.request_id: int | None = None  # its id there (given as the link sends)
        self.result: Any = fallback
        if not queued:
            self.finished_at = self.started_at

    # -- the link's thread ------------------------------------------------------------------

    def attach(self, pending: Pending, epoch: int | None = None,
               daemon: PeerProcess | None = None) -> None:
        self.sent_epoch, self.sent_to = epoch, daemon
        self.request_id = pending.request_id
        self._pending = pending
        self._handled.set()

    def abandon(self) -> None:
        """Never sent (no connection, link closed): completes with the fallback."""
        self._abandoned = True
        self._handled.set()

    def remaining_s(self) -> float:
        """What is left of the deadline (negative once past); any thread."""
        return self._deadline - time.monotonic()

    # -- the caller's thread ----------------------------------------------------------------

    def poll(self) -> bool:
        """True once finished (successfully or not); never blocks."""
        if self.done:
            return True
        pending = self._pending
        if pending is not None and pending.poll():
            try:
                self.result = pending.wait(0)
                self.ok = self.answered = True
            except ClientError as exc:
                self.answered = True
                self._on_error(getattr(exc, "code", "error"))
            except DaemonUnavailable:
                self._on_error("unavailable")
            self._finish(pending.landed_at)
        elif pending is None and self._abandoned:
            self._on_error("unavailable")
            self._finish()
        elif time.monotonic() >= self._deadline:
            self.timed_out = True
            self._on_error("deadline")
            self._finish()
        return self.done

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until done or ``timeout_s`` (default: the deadline): tests, shutdown, and the
        engine's bounded wait for lookup replies."""
        if self.done:
            return True
        end = self._deadline
        if timeout_s is not None:
            end = min(end, time.monotonic() + timeout_s)
        self._handled.wait(max(0.0, end - time.monotonic()))
        pending = self._pending
        if pending is not None:
            with contextlib.suppress(ClientError, DaemonUnavailable):
                pending.wait(max(0.0, end - time.monotonic()))
        return self.poll()

    @property
    def never_sent(self) -> bool:
        """The daemon never saw this request (refused at once, or given up by the link before
        sending): whatever memory it named is the caller's again. False while it may still go
        out."""
        return self._abandoned

    @property
    def lost(self) -> bool:
        """Ended after it went out, with no reply: its deadline passed or its connection was
        lost. The daemon may still touch the memory it named until a newer registration of that
        memory is accepted (``sent_epoch``), or its process has exited (``daemon_exited``)."""
        return self.done and not self.answered and not self._abandoned

    @property
    def daemon_exited(self) -> bool:
        """The process of the daemon it went out to has exited: it touches nothing any more."""
        return self.sent_to is not None and self.sent_to.exited

    @property
    def elapsed_s(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return end - self.started_at

    def _finish(self, landed_at: float | None = None) -> None:
        """Done; ``finished_at`` is when the reply came in (the link's thread), else now."""
        self.done = True
        self.finished_at = landed_at if landed_at is not None else time.monotonic()
        self._pending = None
