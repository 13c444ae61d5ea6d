"""CopyHandle: one submitted batch of device copies, completed when its CUDA event is; CopyWaits:
how a copier's handles wait for theirs.

A thread blocked in ``cudaEventSynchronize`` on a blocking-sync event is woken some time after the
copies ended (~0.1 ms of a 64-block batch's ~2.9 ms, ``benchmarks.copy_wait``). A polled wait
(``CopySettings.wait_poll_us``) sleeps through the time the batch cannot have ended yet, asks the
event every few microseconds near its end, and blocks as before once the batch is well past
when it should have ended (a slower bus, copies of other streams, a fault the event may not show
to a query): never longer than the blocking wait's bound, which is the copy's own.
"""

from __future__ import annotations

import time

from kvstore.engines.cuda_fault import CudaFault

# Faster than any host <-> device copy measured (H100 and H200 raw pinned copies: 55 GB/s):
# until its bytes (and those queued before it on its stream) could have crossed at this rate, a
# batch is surely still copying.
PEAK_BYTES_PER_S = 64e9
# A polled wait asks the event until this long past the batch's earliest end (at least
# MIN_POLL_WINDOW_S, else this share of its estimated time), then blocks on it.
MIN_POLL_WINDOW_S = 0.002
POLL_WINDOW_SHARE = 0.5


def _earliest(after: float, num_bytes: int) -> float:
    """The soonest ``num_bytes`` enqueued behind copies that end no sooner than ``after``
    (``time.perf_counter()``) can have crossed."""
    return max(time.perf_counter(), after) + num_bytes / PEAK_BYTES_PER_S


class CopyHandle:
    """One submitted batch: ``poll()`` never blocks, ``wait()`` blocks until the event completed.

    ``poll_s`` > 0: ``wait`` sleeps until ``earliest_end`` (``time.perf_counter()``; default: the
    batch's ``num_bytes`` at ``PEAK_BYTES_PER_S`` from this handle's creation), polls the event
    every ``poll_s`` until the poll window closes, then blocks on it. ``poll_s`` 0: it blocks.

    Both raise the CUDA error a copy of the batch hit (and show a sticky one to ``fault``).
    """

    def __init__(self, event, num_bytes: int, fault: CudaFault, poll_s: float = 0.0,
                 earliest_end: float | None = None) -> None:
        self._event = event
        self.num_bytes = num_bytes
        self._fault = fault
        self._poll_s = poll_s
        self._created = time.perf_counter()
        self._earliest_end = earliest_end if earliest_end is not None else \
            _earliest(self._created, num_bytes)

    def poll(self) -> bool:
        try:
            return bool(self._event.done)
        except Exception as exc:
            self._fault.observe(exc, "a copy's event")
            raise

    def wait(self) -> None:
        if self._poll_s > 0 and self._polled():
            return
        try:
            self._event.synchronize()
        except Exception as exc:
            self._fault.observe(exc, "a copy's event")
            raise

    def _polled(self) -> bool:
        """True once a poll saw the batch done; False when the poll window closed first."""
        if self.poll():
            return True
        ahead_s = self._earliest_end - time.perf_counter()
        if ahead_s > self._poll_s:
            time.sleep(ahead_s)
        estimate_s = self._earliest_end - self._created
        closes = self._earliest_end + max(MIN_POLL_WINDOW_S, POLL_WINDOW_SHARE * estimate_s)
        while not self.poll():
            if time.perf_counter() >= closes:
                return False
            time.sleep(self._poll_s)
        return True


class CopyWaits:
    """How one copier's handles wait: ``poll_s`` (0: blocking) and, per stream, a lower bound on
    when the copies queued on it end. Not thread-safe: call ``queued`` under the stream's lock,
    right after enqueuing, so the bounds follow the stream's order."""

    def __init__(self, poll_s: float, fault: CudaFault) -> None:
        self.poll_s = poll_s
        self._fault = fault
        self._until: dict[object, float] = {}

    def queued(self, stream_key: object, num_bytes: int) -> float:
        """``num_bytes`` were just enqueued on ``stream_key``'s stream: their earliest end."""
        end = _earliest(self._until.get(stream_key, 0.0), num_bytes)
        self._until[stream_key] = end
        return end

    def handle(self, event, num_bytes: int, earliest_end: float) -> CopyHandle:
        return CopyHandle(event, num_bytes, self._fault, self.poll_s, earliest_end)
