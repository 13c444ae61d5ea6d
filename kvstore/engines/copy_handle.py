"""CopyHandle: one submitted batch of device copies, completed when its CUDA event is."""

from __future__ import annotations

from kvstore.engines.cuda_fault import CudaFault


class CopyHandle:
    """One submitted batch: ``poll()`` never blocks, ``wait()`` blocks on the event.

    Both raise the CUDA error a copy of the batch hit (and show a sticky one to ``fault``).
    """

    def __init__(self, event, num_bytes: int, fault: CudaFault) -> None:
        self._event = event
        self.num_bytes = num_bytes
        self._fault = fault

    def poll(self) -> bool:
        try:
            return bool(self._event.done)
        except Exception as exc:
            self._fault.observe(exc, "a copy's event")
            raise

    def wait(self) -> None:
        try:
            self._event.synchronize()
        except Exception as exc:
            self._fault.observe(exc, "a copy's event")
            raise
