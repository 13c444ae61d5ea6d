"""CopyHandle's wait: polled once the copy may have ended (blocking once it is well overdue), or
blocking; errors reach the fault. CopyWaits: each stream's earliest ends follow its queue.

The CUDA event is stood in for by a clock-driven event (CUDA's, not ours); the GPU path runs in
the copier's GPU tests and ``benchmarks.copy_wait``."""

from __future__ import annotations

import time

import pytest

from kvstore.engines.copy_handle import (
    MIN_POLL_WINDOW_S,
    PEAK_BYTES_PER_S,
    CopyHandle,
    CopyWaits,
)
from kvstore.engines.cuda_fault import CudaFault


class ClockEvent:
    """Completes ``after_s`` from its creation; counts how often it was asked."""

    def __init__(self, after_s: float, error: Exception | None = None,
                 query_error: bool = True) -> None:
        self.ends_at = time.perf_counter() + after_s
        self.error = error
        self.query_error = query_error  # False: a query says "not ready", only a sync raises
        self.queries = 0
        self.synchronized = 0

    @property
    def done(self) -> bool:
        self.queries += 1
        if self.error is not None:
            if not self.query_error:
                return False
            raise self.error
        return time.perf_counter() >= self.ends_at

    def synchronize(self) -> None:
        self.synchronized += 1
        if self.error is not None:
            raise self.error
        time.sleep(max(0.0, self.ends_at - time.perf_counter()))


def test_a_polled_wait_returns_once_the_event_completed_and_sleeps_through_the_copy() -> None:
    num_bytes = int(0.05 * PEAK_BYTES_PER_S)  # could not end before 50 ms
    event = ClockEvent(0.06)
    handle = CopyHandle(event, num_bytes, CudaFault(), poll_s=0.001)
    handle.wait()
    assert time.perf_counter() >= event.ends_at
    assert event.synchronized == 0
    # slept through the first 50 ms: at most ~10 ms of 1 ms polls after the first question
    assert event.queries <= 15


def test_a_wait_on_a_completed_copy_asks_once() -> None:
    event = ClockEvent(0.0)
    CopyHandle(event, 0, CudaFault(), poll_s=0.001).wait()
    assert event.queries == 1


def test_poll_0_blocks_in_the_event() -> None:
    event = ClockEvent(0.01)
    CopyHandle(event, 1 << 20, CudaFault(), poll_s=0.0).wait()
    assert event.synchronized == 1 and event.queries == 0
    assert time.perf_counter() >= event.ends_at


@pytest.mark.parametrize("poll_s", [0.0, 0.001])
def test_an_error_at_the_event_is_raised_and_a_sticky_one_poisons_the_fault(
        poll_s: float) -> None:
    fault = CudaFault()
    error = RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
    handle = CopyHandle(ClockEvent(0.0, error), 1 << 20, fault, poll_s=poll_s)
    with pytest.raises(RuntimeError, match="illegal"):
        handle.wait()
    assert fault.poisoned


def test_an_overdue_copy_is_waited_for_blocking_after_the_poll_window() -> None:
    """A fault the event's query does not show (it only ever says "not ready") surfaces at the
    blocking wait once the window closed: the poll never spins for good."""
    fault = CudaFault()
    error = RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
    event = ClockEvent(0.0, error, query_error=False)
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="illegal"):
        CopyHandle(event, 1 << 20, fault, poll_s=0.0005).wait()
    assert event.synchronized == 1 and fault.poisoned
    assert time.perf_counter() - started < MIN_POLL_WINDOW_S + 0.5


def test_a_slow_copy_ends_in_the_blocking_wait() -> None:
    event = ClockEvent(0.05)  # far past the window of a 1 MiB batch
    CopyHandle(event, 1 << 20, CudaFault(), poll_s=0.0005).wait()
    assert event.synchronized == 1 and time.perf_counter() >= event.ends_at


def test_each_streams_earliest_ends_follow_its_queue() -> None:
    waits = CopyWaits(0.00002, CudaFault())
    num_bytes = int(0.01 * PEAK_BYTES_PER_S)  # 10 ms at the peak rate
    before = time.perf_counter()
    first = waits.queued("h2d", num_bytes)
    second = waits.queued("h2d", num_bytes)  # behind the first on its stream
    other = waits.queued("d2h", num_bytes)  # a stream of its own
    assert first >= before + 0.01 and second >= first + 0.01
    assert other < second - 0.005
    handle = waits.handle(ClockEvent(0.0), num_bytes, second)
    handle.wait()  # done already: one question, no sleep
