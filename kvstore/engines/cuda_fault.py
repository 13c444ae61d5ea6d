"""The daemon's CUDA context: healthy until a sticky error is seen, then poisoned for good.

Some CUDA errors (an illegal address, a failed launch) are sticky: the context that met one
fails every later call, for every engine the daemon serves, and only a new process gets a new
context. The first such error seen anywhere (a copy's submission or its event) poisons the
``CudaFault``: it is logged once with its reason, every copier refuses further copies without
calling CUDA (``check``), the daemon's health turns ``failing`` with the reason, and the
listeners given to the constructor are told once (the daemon stops and exits with
``EXIT_CUDA_POISONED`` so its supervisor starts a fresh one; engines outlive a daemon restart).
Errors that are not sticky (an invalid argument) stay the failure of that one copy.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

# The exit status of a daemon whose CUDA context was poisoned (sysexits' EX_SOFTWARE).
EXIT_CUDA_POISONED = 70

# cudaError_t / CUresult codes after which the context is unusable (same numbers in both APIs).
STICKY_ERRORS = {
    214: "uncorrectable ECC error",
    700: "illegal address",
    702: "launch timeout",
    714: "hardware stack error",
    715: "illegal instruction",
    716: "misaligned address",
    717: "invalid address space",
    718: "invalid program counter",
    719: "launch failure",
}
_STICKY_NAMES = ("IllegalAddress", "ILLEGAL_ADDRESS", "LaunchFailure", "LAUNCH_FAILED",
                 "IllegalInstruction", "ILLEGAL_INSTRUCTION", "MisalignedAddress",
                 "MISALIGNED_ADDRESS", "HardwareStackError", "HARDWARE_STACK_ERROR",
                 "ECCUncorrectable", "ECC_UNCORRECTABLE", "InvalidPc", "INVALID_PC",
                 "InvalidAddressSpace", "INVALID_ADDRESS_SPACE", "LaunchTimeout",
                 "LAUNCH_TIMEOUT")


class ContextPoisoned(RuntimeError):
    """A sticky CUDA error poisoned this process's context: no copy is submitted any more."""


def is_sticky(exc: BaseException) -> bool:
    """True when ``exc`` is a CUDA error that leaves the context unusable (CuPy's runtime and
    driver errors carry ``status``; others are recognised by the error's name)."""
    if isinstance(exc, ContextPoisoned):
        return True
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status in STICKY_ERRORS
    text = str(exc)
    return any(name in text for name in _STICKY_NAMES)


class CudaFault:
    """Poisoned once a sticky error is observed; thread-safe. ``reason`` says which and where."""

    def __init__(self, listeners: Sequence[Callable[[str], None]] = ()) -> None:
        self._listeners = list(listeners)
        self._lock = threading.Lock()
        self.reason: str | None = None

    @property
    def poisoned(self) -> bool:
        return self.reason is not None

    def add_listener(self, listener: Callable[[str], None]) -> None:
        """``listener(reason)`` is called once, on the thread that sees the first sticky error
        (at once if that has happened already)."""
        with self._lock:
            self._listeners.append(listener)
            reason = self.reason
        if reason is not None:
            listener(reason)

    def check(self) -> None:
        """ContextPoisoned once poisoned: call before any CUDA work."""
        reason = self.reason
        if reason is not None:
            raise ContextPoisoned(f"the daemon's CUDA context is poisoned ({reason}); no copy "
                                  "runs until the daemon restarts")

    def observe(self, exc: BaseException, where: str) -> None:
        """Poison on a sticky error (logged and told once); anything else is left alone."""
        if isinstance(exc, ContextPoisoned) or not is_sticky(exc):
            return
        with self._lock:
            if self.reason is not None:
                return
            self.reason = f"{where}: {exc}"
            listeners = list(self._listeners)
        log.critical("sticky CUDA error, the daemon's CUDA context is unusable and every copy "
                     "stops: %s", self.reason)
        for listener in listeners:
            try:
                listener(self.reason)
            except Exception:
                log.exception("a CUDA fault listener failed")
