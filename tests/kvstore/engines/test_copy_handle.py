"""CopyHandle's wait: polled once the copy may have ended, or blocking; errors reach the fault.

The CUDA event is stood in for by a clock-driven event (CUDA's, not ours); the GPU path runs in
the copier's GPU tests and ``benchmarks.copy_wait``."""

from __future__ import annotations

import time

import pytest

from kvstore.engines.copy_handle import PEAK_BYTES_PER_S, CopyHandle
from kvstore.engines.cuda_fault import CudaFault


class ClockEvent:
    """Completes ``after_s`` from its creation; counts how often it was asked."""

    def __init__(self, after_s: float, error: Exception | None = None) -> None:
        self.ends_at = time.perf_counter() + after_s
        self.error = error
        self.queries = 0
        self.synchronized = 0

    @property
    def done(self) -> bool:
        self.queries += 1
        if self.error is not None:
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
