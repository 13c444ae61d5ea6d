"""configure_logging: kvengine's log lines carry time, level and logger name, as the daemon's do."""

from __future__ import annotations

import argparse
import logging

from kvstore.log_lines import LOG_FORMATS, configure

# The start-up lines (loading, listening on...): kvstore.log_lines writes them as the message
# alone in text (the same format `kvstore serve` uses for the rest), as JSON in json.
BANNER_LOGGER = "kvengine.banner"
# The packages whose loggers --log-level governs; other libraries stay at warning.
OUR_LOGGERS = ("engine", "offload", "kernels", "server", "kvengine", "kvstore")


def configure_logging(level: str, log_format: str = "text") -> logging.Logger:
    """One stderr handler on the root logger in ``log_format`` (text or json); our loggers at
    `level` ("info", ...), everything else (uvicorn's own loggers are set by uvicorn) at
    warning. Returns the banner logger (start-up lines: always written, to stderr)."""
    banner = configure(log_format, BANNER_LOGGER)
    logging.getLogger().setLevel(logging.WARNING)
    for name in OUR_LOGGERS:
        logging.getLogger(name).setLevel(level.upper())
    # "connected to kvstore at ..." and its reconnects show at the default level too.
    logging.getLogger("offload.connection").setLevel(
        min(logging.INFO, logging.getLevelName(level.upper())))
    return banner


def add_log_format_option(parser: argparse.ArgumentParser) -> None:
    """``--log-format text|json`` (``kvengine serve`` and ``router``)."""
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                        help="text: 'time level logger: message' (the start-up lines: the "
                        "message alone); json: one JSON object per line (time, level, logger, "
                        "message), the start-up lines and uvicorn's included")
