"""DirectReply: a worker verb's reply, written by the worker the moment its call returns.

A copy verb (save, load, lookup_load) runs on a worker thread. Its reply used to wait for the
event loop: the worker's completion woke the loop, which resumed the request, counted it,
encoded the reply and wrote it (~0.19 ms on an H100 host, ``benchmarks/request_trace.py``).
Here the worker encodes the reply and writes it through the connection's ``ReplyWire``; the
loop still counts the request and frees its slots afterwards, off the client's path.

Exactly one side answers, whoever claims the reply first: the worker once its call returned
(an ok reply), the loop when it gives up on the call (the deadline passed, the connection
closed) and, in any case, once the call ended (a call that raised is answered by the loop, as
before). A worker whose write the wire declines (unsent bytes ahead of it, a closed
connection) leaves the encoded frame to the loop.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from typing import Any

from kvstore.daemon.connection import encode_reply
from kvstore.daemon.reply_wire import ReplyWire
from kvstore.wire import protocol as proto


class _Answerer(enum.Enum):
    """Who answers a request: nobody has claimed it yet, its worker, or the loop."""

    UNCLAIMED = "unclaimed"
    WORKER = "worker"
    LOOP = "loop"


class DirectReply:
    """One request's reply; ``run`` on the worker, ``claim`` and the fields on the loop."""

    def __init__(self, wire: ReplyWire, request_id: int, max_frame_bytes: int) -> None:
        self._wire = wire
        self._request_id = request_id
        self._max_frame_bytes = max_frame_bytes
        self._lock = threading.Lock()
        self._answerer = _Answerer.UNCLAIMED
        self.sent_at: float | None = None  # when the worker wrote it (monotonic)
        self.frame: list[bytes] | None = None  # encoded by the worker, for the loop to write

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``'s result; its ok reply written unless the loop claimed the reply
        first. An exception propagates, unanswered: the loop answers it."""
        result = fn(*args)
        frame = encode_reply(proto.ok_reply(self._request_id, result), self._max_frame_bytes)
        with self._lock:
            if self._answerer is not _Answerer.UNCLAIMED:
                return result
            self._answerer = _Answerer.WORKER
        joined = b"".join(frame)
        try:
            sent = self._wire.write_from_worker(joined)
        except Exception:  # noqa: BLE001 - whatever went wrong here, the loop writes it
            sent = False
        if sent:
            self.sent_at = time.monotonic()
        else:
            self.frame = [joined]
        return result

    def claim(self) -> bool:
        """On the loop: True when the loop answers (the worker had not claimed it, and now
        never will); False when the worker's reply stands: then it was written (``sent``) or
        left for the loop to write (``frame``)."""
        with self._lock:
            if self._answerer is _Answerer.UNCLAIMED:
                self._answerer = _Answerer.LOOP
            return self._answerer is _Answerer.LOOP

    @property
    def sent(self) -> bool:
        return self.sent_at is not None
