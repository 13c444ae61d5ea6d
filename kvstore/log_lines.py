"""How both programs (``kvstore``, ``kvengine``) write log lines: ``--log-format text`` (time,
level, logger: message) or ``json`` (one object a line: time, level, logger, message, exception),
the banner (start-up, ready and stop lines, errors at start) through logging too, so a log
collector that reads JSON gets every line as JSON.

The banner has a logger of its own that always writes (whatever ``--log-level``) and, as text,
only the message, as before: ``kvstore: ready (pid N)`` is still a line of its own.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import TextIO

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (UTC, ISO 8601), ``level``, ``logger``,
    ``message`` and, when the record carries one, ``exception`` (the traceback's text)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.fromtimestamp(record.created, tz=timezone.utc)
               .isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def _formatter(log_format: str, text_format: str) -> logging.Formatter:
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got "
                         f"{log_format!r}")
    return JsonFormatter() if log_format == "json" else logging.Formatter(text_format)


def configure(log_format: str, banner_name: str,
              root_stream: TextIO | None = None) -> logging.Logger:
    """One handler on the root logger (``root_stream``, default stderr) in ``log_format``, and
    the banner logger ``banner_name``: info and up always written to stderr, as every other line
    (the daemon, the engine and the router write their start-up lines, ``listening on`` among
    them, where they write their logs). Replaces what an earlier call installed. Returns the
    banner logger."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_kvstore_lines", False)]:
        root.removeHandler(handler)
    handler = logging.StreamHandler(root_stream or sys.stderr)
    handler.setFormatter(_formatter(log_format, TEXT_FORMAT))
    handler._kvstore_lines = True  # type: ignore[attr-defined]
    root.addHandler(handler)

    banner = logging.getLogger(banner_name)
    for old in list(banner.handlers):
        banner.removeHandler(old)
    banner.setLevel(logging.INFO)
    banner.propagate = False  # written here only, whatever the root's level
    lines = logging.StreamHandler(sys.stderr)
    lines.setFormatter(_formatter(log_format, "%(message)s"))
    lines._kvstore_lines = True  # type: ignore[attr-defined]
    banner.addHandler(lines)
    return banner
