"""configure_logging: kvengine's log lines carry time, level and logger name, as the daemon's do."""

from __future__ import annotations

import logging
import sys

# The same format `kvstore serve` uses, so the two programs' logs interleave readably.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The packages whose loggers --log-level governs; other libraries stay at warning.
OUR_LOGGERS = ("engine", "offload", "kernels", "server", "kvengine", "kvstore")


def configure_logging(level: str) -> None:
    """One stderr handler on the root logger; our loggers at `level` ("info", ...), everything
    else (uvicorn's own loggers are set by uvicorn) at warning."""
    root = logging.getLogger()
    if not any(getattr(h, "_kvengine", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler._kvengine = True  # type: ignore[attr-defined]  # installed once per process
        root.addHandler(handler)
    root.setLevel(logging.WARNING)
    for name in OUR_LOGGERS:
        logging.getLogger(name).setLevel(level.upper())
