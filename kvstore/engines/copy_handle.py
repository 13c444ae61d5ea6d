"""CopyHandle: one submitted batch of device copies, completed when its CUDA event is."""

from __future__ import annotations

import time

from kvstore.engines.cuda_fault import CudaFault

# Faster than any host <-> device copy measured (H100 and H200 raw pinned copies: 55 GB/s):
# until its bytes could have crossed at this rate, a batch is surely still copying.
PEAK_BYTES_PER_S = 64e9


class CopyHandle:
    """One submitted batch: ``poll()`` never blocks, ``wait()`` blocks until the event completed.

    ``poll_s`` > 0: ``wait`` sleeps through the time the batch cannot have ended yet (its
    ``num_bytes`` at ``PEAK_BYTES_PER_S`` from this handle's creation, right after submission),
    then polls the event every ``poll_s``: a thread blocked in ``cudaEventSynchronize`` on a
    blocking-sync event is woken ~0.1 ms after the copy ended (``benchmarks.copy_wait``), which
    a few microseconds of CPU per poll avoid. ``poll_s`` 0: that blocking wait.

    Both raise the CUDA error a copy of the batch hit (and show a sticky one to ``fault``).
    """

    def __init__(self, event, num_bytes: int, fault: CudaFault, poll_s: float = 0.0) -> None:
        self._event = event
        self.num_bytes = num_bytes
        self._fault = fault
        self._poll_s = poll_s
        self._earliest_end = time.perf_counter() + num_bytes / PEAK_BYTES_PER_S

    def poll(self) -> bool:
        try:
            return bool(self._event.done)
        except Exception as exc:
            self._fault.observe(exc, "a copy's event")
            raise

    def wait(self) -> None:
        if self._poll_s <= 0:
            try:
                self._event.synchronize()
            except Exception as exc:
                self._fault.observe(exc, "a copy's event")
                raise
            return
        if self.poll():
            return
        ahead_s = self._earliest_end - time.perf_counter()
        if ahead_s > self._poll_s:
            time.sleep(ahead_s)
        while not self.poll():
            time.sleep(self._poll_s)
