"""TimingLog: where each finished engine request's time went. ``RequestTimingLog`` writes one JSON
line per request; ``NoTimingLog`` (no ``--request-timing-log``) writes nothing.

``kvengine serve --request-timing-log FILE`` appends, when each engine request ends, the
response's ``id`` (which carries a client's ``request_id``), the engine's request id, token
counts, and ``time.perf_counter()`` stamps in seconds: ``received`` (the handler had the parsed
body), ``added`` (the engine took it), ``scheduled`` (first in a batch), ``first_token`` (the
engine produced it), ``first_token_seen`` (the server's loop turned it into a chunk) and
``finished``; where the engine says, ``taken`` (its step thread took the request: a store
lookup goes out from there) and ``restore`` (a restored one's round trip sent, its load landed,
the restore ready to run). On Linux ``perf_counter`` is CLOCK_MONOTONIC, one clock for every
process of the host, so a client on the same host can set these against its own send and
receive times (``benchmarks.multiturn`` does). Aborted requests are logged too
(``finish_reason`` abort).

The file is bounded: past ``max_bytes`` nothing more is written and the lines left out are
counted (``num_dropped``, logged once). A write that fails (a full disk) closes the log with one
error message; serving goes on either way.
"""

from __future__ import annotations

import json
import logging
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from server.engine_protocol import EngineOutput
    from server.responses import ChoiceState

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 << 20


class TimingLog(ABC):
    """Where finished requests' time went; event loop only (not thread-safe). ``path``: the
    file (None when nothing is written); ``num_written`` / ``num_dropped``: lines."""

    path: Path | None = None
    num_written = 0
    num_dropped = 0

    @abstractmethod
    def finished(self, response_id: str, request_id: str, choice: ChoiceState,
                 received: float, now: float, out: EngineOutput | None = None) -> None:
        """An engine request ended (``out``: its last output; None for an abort, which has no
        engine stamps)."""

    @abstractmethod
    def record(self, row: dict[str, Any]) -> None:
        """Log ``row`` as it is."""

    @abstractmethod
    def close(self) -> None:
        """Nothing is logged after this. Idempotent."""


class NoTimingLog(TimingLog):
    """No timing log: every call does nothing (no row is even built)."""

    def finished(self, response_id: str, request_id: str, choice: ChoiceState,
                 received: float, now: float, out: EngineOutput | None = None) -> None:
        return None

    def record(self, row: dict[str, Any]) -> None:
        return None

    def close(self) -> None:
        return None


class RequestTimingLog(TimingLog):
    """Appends one line per finished request to ``path`` (created 0600 if absent)."""

    def __init__(self, path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.num_written = 0
        self.num_dropped = 0
        # append, line-buffered: a line is on disk once written, a crash loses none of them;
        # open for the server's life (closed by close())
        self._file: TextIO | None = open(  # noqa: SIM115
            self.path, "a", buffering=1, encoding="utf-8",
            opener=lambda p, flags: os.open(p, flags, 0o600))
        self._bytes = self._file.tell()

    def finished(self, response_id: str, request_id: str, choice: ChoiceState,
                 received: float, now: float, out: EngineOutput | None = None) -> None:
        self.record({
            "id": response_id, "request_id": request_id, "finish_reason": choice.finish_reason,
            "prompt_tokens": choice.num_prompt_tokens, "completion_tokens": choice.num_tokens,
            "cached_tokens": choice.num_cached_tokens,
            "cached_tokens_by_tier": choice.cached_tokens_by_tier,
            "received": received, "added": out.arrival_time if out is not None else None,
            "scheduled": out.first_scheduled_time if out is not None else None,
            "first_token": out.first_token_time if out is not None else None,
            "first_token_seen": choice.first_token_time, "finished": now,
            "taken": out.taken_time if out is not None else None,
            "restore": list(out.restore_times) if out is not None and out.restore_times else None})

    def record(self, row: dict[str, Any]) -> None:
        """Append ``row`` as one line (dropped and counted once the file is full or closed)."""
        if self._file is None:  # closed (or a write failed)
            self.num_dropped += 1
            return
        line = json.dumps(row, separators=(",", ":")) + "\n"
        if self._bytes + len(line) > self.max_bytes:
            if not self.num_dropped:
                log.warning("request timing log %s reached %d bytes: further requests are not "
                            "logged", self.path, self.max_bytes)
            self.num_dropped += 1
            return
        try:
            self._file.write(line)
        except OSError as exc:
            log.error("request timing log %s: %s; no more lines are written", self.path, exc)
            self.num_dropped += 1
            self.close()
            return
        self._bytes += len(line)
        self.num_written += 1

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError as exc:
                log.error("request timing log %s: %s", self.path, exc)
