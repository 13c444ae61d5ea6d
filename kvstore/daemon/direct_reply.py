"""A worker's reply written by the worker: who answers a request, and the call that does.

A call run on a worker used to hand its result back to the event loop, which encoded the reply
and wrote it: a thread hop and a few loop turns (0.1-0.3 ms, more while the loop is busy) that
every save and load paid after its copies had landed. Now the worker encodes a small reply and
writes it itself (``Connection.send_now``), and the loop only counts the call and frees its
slot. Whichever of the two acts first owns the answer (``ReplyGate``): a worker that finishes
after the loop gave up on the deadline writes nothing (the loop answers ``deadline_exceeded``
and releases what the call took, as before), and a loop that times out after the worker took
the answer waits for it instead of answering twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvstore.daemon.connection import BULK_REPLY_VERBS, Connection, encode_reply
from kvstore.wire import protocol as proto

# Replies up to this size may go straight from the worker: acknowledgements and block outcomes
# (a load or save of 1,024 blocks answers in ~10 KB), never a get's value.
MAX_DIRECT_REPLY_BYTES = 64 * 1024


class _Sent:
    """The reply went out from the worker: the loop writes nothing."""

    def __repr__(self) -> str:
        return "SENT"


SENT = _Sent()


class ReplyGate:
    """Who answers one request: the worker that ran it or the loop; the first to ``take`` it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken = False

    def take(self) -> bool:
        with self._lock:
            taken, self._taken = self._taken, True
            return not taken


def call_and_reply(call: Callable[[], Any], conn: Connection, request: proto.Request,
                   gate: ReplyGate, max_frame_bytes: int, counts: Callable[[str], None]) -> Any:
    """Run ``call`` on this worker and, if the answer is still ours, write its small success
    reply to the socket: SENT, or the result for the loop to send (an exception too goes to
    the loop). ``counts`` names how it went: ``replies_from_worker`` or
    ``replies_handed_to_loop``."""
    result = call()
    if request.verb in BULK_REPLY_VERBS or not gate.take():
        return result  # a value to send in turn, or the loop has given up on the deadline
    frame = encode_reply(proto.ok_reply(request.request_id, result), max_frame_bytes)
    if sum(len(part) for part in frame) <= MAX_DIRECT_REPLY_BYTES and conn.send_now(frame):
        counts("replies_from_worker")
        return SENT
    counts("replies_handed_to_loop")
    return result

