"""What a backend builds on first use (CUDA graph captures, cuDNN graphs, kernel modules),
counted and timed.

A capture or a cuDNN build costs tens to hundreds of milliseconds, and a request that meets one
waits for it. The engine builds what it can before it says ready (``warm_up``) and then
``seal``s the log: every build after that is a first-use cost a request paid, logged once per
build with its kind, key and time, and counted, so a test or an operator can see that none
happened (``/metrics``: ``kvengine:first_use_builds_total``). A build after ready that no
request waited for (beside a device step the step thread waits for anyway, ending before it,
or while the engine was idle) is counted apart (``hidden``).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("kernels.builds")


class BuildKind(str, enum.Enum):
    """What was built (the ``kind`` label of ``kvengine:first_use_builds_total``)."""

    CUDA_GRAPH = "cuda_graph"
    CUDNN_GRAPH = "cudnn_graph"
    CUDNN_LOAD = "cudnn_plan_load"  # a built graph loaded from the disk cache (plan_cache.py)
    # a graph the builder process built while our kernel served (plan_builder.py), loaded
    CUDNN_BACKGROUND = "cudnn_background_load"
    # one of our .cu families compiled by NVRTC for a set of defines (or loaded from CuPy's disk
    # cache): seconds on a fresh machine, so a request must never be the first to need one
    KERNEL_MODULE = "kernel_module"


CUDA_GRAPH, CUDNN_GRAPH, CUDNN_LOAD, CUDNN_BACKGROUND, KERNEL_MODULE = BuildKind


class BuildLog:
    """Counts and times builds by kind, before and after ``seal``; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.sealed = False
        self.before: Counter[BuildKind] = Counter()  # builds before seal, by kind
        self.after: Counter[BuildKind] = Counter()  # first-use builds: after seal, by kind
        self.seconds_before: Counter[BuildKind] = Counter()
        self.seconds_after: Counter[BuildKind] = Counter()
        self.hidden: Counter[BuildKind] = Counter()  # after seal, no request waited for them
        self.seconds_hidden: Counter[BuildKind] = Counter()

    @contextmanager
    def building(self, kind: BuildKind, key: object) -> Iterator[None]:
        """Time the build of ``key`` inside the block (counted only if it returns)."""
        start = self._clock()
        yield
        self.record(kind, key, self._clock() - start)

    def record(self, kind: BuildKind, key: object, seconds: float) -> None:
        """A build of ``seconds`` that whoever asked for it waited for."""
        with self._lock:
            late = self.sealed
            (self.after if late else self.before)[kind] += 1
            (self.seconds_after if late else self.seconds_before)[kind] += seconds
        if late:
            log.warning("first-use build after ready: %s %s took %.1f ms (a request waited)",
                        kind.value, key, seconds * 1e3)

    def record_hidden(self, kind: BuildKind, key: object, seconds: float) -> None:
        """After the seal, a build that no request waited for (it ran while the device ran a
        step the step thread waits for anyway and ended before it, or while the engine was
        idle): counted, not a stall."""
        with self._lock:
            self.hidden[kind] += 1
            self.seconds_hidden[kind] += seconds
        log.debug("build no request waited for: %s %s took %.1f ms", kind.value, key,
                  seconds * 1e3)

    def seal(self) -> None:
        """From now on every build is a first-use cost (logged, counted in ``after``)."""
        with self._lock:
            self.sealed = True

    def snapshot(self) -> dict:
        """Counts and seconds by kind's name: ``before`` / ``after`` the seal, ``hidden``
        (after it, no request waited), ``seconds_*`` alike."""
        with self._lock:
            return {"before": {k.value: n for k, n in self.before.items()},
                    "after": {k.value: n for k, n in self.after.items()},
                    "hidden": {k.value: n for k, n in self.hidden.items()},
                    "seconds_before": {k.value: round(v, 4)
                                       for k, v in self.seconds_before.items()},
                    "seconds_after": {k.value: round(v, 4)
                                      for k, v in self.seconds_after.items()},
                    "seconds_hidden": {k.value: round(v, 4)
                                       for k, v in self.seconds_hidden.items()}}
