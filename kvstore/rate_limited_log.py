"""RateLimitedLog: at most one log line per kind of event per interval, with a count of the rest.

An attack repeats one event thousands of times a second (connections refused, requests timed
out, accepts failing for lack of descriptors); logging each one turned a file-descriptor flood
into half a gigabyte of log in minutes. The daemon's socket, its admin port and the engine's HTTP
front all log through one of these.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitedLog:
    """Logs the first event of a kind at once (saying that repeats are counted), then at most one
    line per ``interval_s`` for that kind, saying how many events the line stands for. A kind is
    one failure, not a family of them: callers fold what tells failures apart (an errno, an
    exception's type) into it. ``message % args`` is formatted only for a line that goes out.
    ``counts`` holds every event counted, by kind. Not thread-safe: one event loop's (or one
    lock's) use. A count suppressed at the end of a flood is written only with the kind's next
    line."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last_s: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self.counts: dict[str, int] = {}

    def event(self, kind: str, message: str, *args: object, level: int = logging.WARNING,
              exc_info: bool = False) -> None:
        """Count one event of ``kind``; log ``message % args`` at ``level`` (with the exception
        being handled if ``exc_info``) unless a line for ``kind`` went out lately."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        now = self._clock()
        last = self._last_s.get(kind)
        if last is not None and now - last < self._interval_s:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last_s[kind] = now
        if args:
            message = message % args
        skipped = self._suppressed.pop(kind, 0)
        if skipped:
            message += f" (and {skipped} more like it in the last {now - last:.0f} s)"
        elif last is None:
            message += f" (repeats: one line per {self._interval_s:g} s, with a count)"
        self._logger.log(level, message, exc_info=exc_info)
