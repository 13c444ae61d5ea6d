"""PendingTable: a connection's requests awaiting replies, by request id, and the error that
ended the connection.

Once the connection ends (closed here, the daemon gone, a protocol mismatch) the first error
given stays: every request then in flight fails, and every later ``add`` raises it.
"""

from __future__ import annotations

import threading

from kvstore.wire.replies import Pending, error_of


class PendingTable:
    """Thread-safe: senders ``add``, the reader thread ``finish``es, a timed-out wait
    ``forget``s. The lock guards the table alone: no frame is read or written under it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, Pending] = {}
        self._closed_error: BaseException | None = None

    @property
    def closed_error(self) -> BaseException | None:
        """Why the connection ended, or None while it is open."""
        return self._closed_error

    def add(self, pending: Pending) -> None:
        """Wait for ``pending``'s reply; raises the closing error once the connection ended."""
        with self._lock:
            if self._closed_error is not None:
                raise self._closed_error
            self._pending[pending.request_id] = pending

    def forget(self, request_id: int) -> None:
        """Stop waiting for this reply (its wait timed out): a late reply finds nobody."""
        with self._lock:
            self._pending.pop(request_id, None)

    def finish(self, reply: dict) -> None:
        """Hand a reply to the request it answers: its result, or the ClientError it carries.
        A reply nobody waits for any more (forgotten, or connection-level) is dropped."""
        with self._lock:
            pending = self._pending.pop(reply.get("id"), None)
        if pending is None:
            return
        if reply.get("ok"):
            pending.finish(reply.get("result"))
        else:
            pending.finish(error=error_of(reply))

    def close(self, error: BaseException) -> None:
        """End the connection with ``error`` (unless it ended already); requests in flight wait
        for their replies or for ``fail_all``."""
        with self._lock:
            if self._closed_error is None:
                self._closed_error = error

    def fail_all(self, error: BaseException) -> None:
        """End the connection with ``error`` (unless it ended already); every request in
        flight fails with ``error``."""
        with self._lock:
            if self._closed_error is None:
                self._closed_error = error
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            p.finish(error=error)
