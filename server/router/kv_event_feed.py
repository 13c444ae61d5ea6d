"""KVEventFeed: one vLLM engine's KV events, subscribed to over ZMQ, kept as its residency.

vLLM's publisher (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'``) sends each step's batch as
three frames, ``[topic, seq (8 bytes, big-endian), payload]``, with ``seq`` counting from 0. A
subscriber misses what was sent before it joined and whatever its queue dropped, so the feed
checks the sequence: a gap is filled from the publisher's replay socket (a DEALER sends the
first missing ``seq``; the publisher answers every buffered batch from there, then an end
marker of ``seq`` -1), and where that is not configured, or does not deliver every missing batch
within ``replay_timeout_s``, the residency is cleared (``resync``: a smaller hit, never a stale
one). A sequence that starts again at 0 is a restarted engine (an empty cache): cleared too. On
joining, the feed asks the replay socket for what the engine has buffered so far.

One thread per engine; every wait is bounded (``poll_s``), a frame larger than
``max_message_bytes`` drops the connection (ZMQ's own limit), an unreadable batch is counted
and resyncs. ``stop`` returns within about ``poll_s + replay_timeout_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import zmq

from server.router.engine_residency import EngineResidency
from server.router.vllm_events import EventFormatError, decode_batch

logger = logging.getLogger("kvengine.router")

_END_SEQ = -1


class KVEventFeed:
    """Keeps ``residency`` from the events published at ``endpoint``."""

    def __init__(self, name: str, endpoint: str, residency: EngineResidency,
                 replay_endpoint: str | None = None, replay_timeout_s: float = 1.0,
                 poll_s: float = 0.1, max_message_bytes: int = 64 << 20) -> None:
        if replay_timeout_s <= 0 or poll_s <= 0 or max_message_bytes <= 0:
            raise ValueError("replay_timeout_s, poll_s and max_message_bytes must be positive")
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.residency = residency
        self.replay_timeout_s = replay_timeout_s
        self.poll_s = poll_s
        self.max_message_bytes = max_message_bytes
        self.last_seq: int | None = None
        self.counters: Counter[str] = Counter()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._context = zmq.Context()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"kv-events-{self.name}",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        self._stopping.set()
        thread = self._thread
        if thread is None:
            self._context.term()  # never started: the thread would have closed it
            return
        thread.join(timeout_s if timeout_s is not None
                    else self.poll_s + self.replay_timeout_s + 1.0)

    def stats(self) -> dict[str, int]:
        return {**self.counters, **{f"residency_{k}": v for k, v in self.residency.stats().items()}}

    # ---- the feed's thread -----------------------------------------------------------------
    def _socket(self, kind: int, endpoint: str) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        return sock

    def _run(self) -> None:
        try:
            sub = self._socket(zmq.SUB, self.endpoint)
        except zmq.ZMQError as exc:
            logger.error("kv events of engine %s: cannot subscribe to %s: %s", self.name,
                         self.endpoint, exc)
            self.counters["subscribe_errors"] += 1
            return
        logger.info("kv events of engine %s: subscribed to %s%s", self.name, self.endpoint,
                    f" (replay {self.replay_endpoint})" if self.replay_endpoint else "")
        try:
            while not self._stopping.is_set():
                if not sub.poll(int(self.poll_s * 1000)):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self._unreadable(f"{len(frames)} frames")
                    continue
                self._accept(int.from_bytes(frames[1], "big", signed=True), frames[2])
        finally:
            sub.close(linger=0)
            self._context.term()

    def _accept(self, seq: int, payload: bytes) -> None:
        last = self.last_seq
        if last is None:
            if seq > 0 and self.replay_endpoint:
                self._replay(0, seq, joining=True)
        elif seq <= last:
            if seq != 0:
                self.counters["duplicates"] += 1  # already had it (a replay overlapped)
                return
            logger.info("kv events of engine %s: the sequence started again (a restarted "
                        "engine): its blocks are forgotten", self.name)
            self.counters["restarts"] += 1
            self.residency.resync()
        elif seq > last + 1:
            self.counters["gaps"] += 1
            if not self._replay(last + 1, seq, joining=False):
                self.residency.resync()
        self._apply(payload)
        self.last_seq = seq

    def _apply(self, payload: bytes) -> bool:
        try:
            batch = decode_batch(payload)
        except EventFormatError as exc:
            self._unreadable(str(exc))
            return False
        self.residency.apply(batch.events)
        self.counters["batches"] += 1
        self.counters["events"] += len(batch.events)
        return True

    def _unreadable(self, why: str) -> None:
        if not self.counters["unreadable"]:
            logger.warning("kv events of engine %s: an unreadable batch (%s); its blocks are "
                           "forgotten (counted from now on)", self.name, why)
        self.counters["unreadable"] += 1
        self.residency.resync()

    def _replay(self, first: int, stop: int, joining: bool) -> bool:
        """Apply batches ``first .. stop - 1`` from the replay socket; True when every one of
        them came (on joining, whatever is buffered counts)."""
        if not self.replay_endpoint:
            return False
        expected = first
        deadline = time.monotonic() + self.replay_timeout_s
        try:
            dealer = self._socket(zmq.DEALER, self.replay_endpoint)
        except zmq.ZMQError:
            self.counters["replay_failures"] += 1
            return False
        try:
            dealer.send_multipart((b"", first.to_bytes(8, "big")))
            while (left := deadline - time.monotonic()) > 0:
                if not dealer.poll(int(left * 1000) + 1):
                    break
                frames = dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    break
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == _END_SEQ:
                    break
                if seq < expected or seq >= stop:
                    continue
                if seq != expected and not joining:
                    break  # the buffer no longer holds what was missed
                if not self._apply(frames[3]):
                    return False
                expected = seq + 1
                self.counters["replayed_batches"] += 1
        finally:
            dealer.close(linger=0)
        complete = joining or expected == stop
        if not complete:
            self.counters["replay_failures"] += 1
        return complete
