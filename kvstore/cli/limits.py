"""`kvstore serve`'s flags for what clients may hold: connections, buffered bytes, timeouts."""

from __future__ import annotations

import argparse
from typing import Any

from kvstore.cli.args import positive_float_arg, positive_int_arg, size_arg
from kvstore.sizes import parse_size

DEFAULT_MAX_BUFFERED = "1GiB"


def add_limit_flags(serve: argparse.ArgumentParser) -> None:
    from kvstore.daemon.limits import (
        DEFAULT_FRAME_TIMEOUT_S,
        DEFAULT_IDLE_TIMEOUT_S,
        DEFAULT_SLOW_READER_TIMEOUT_S,
    )

    serve.add_argument("--max-connections", type=positive_int_arg, default=None, metavar="N",
                       help="cap on open client connections; past it a new one gets an error "
                            "frame and is closed (default: half the fd limit, at most 4096)")
    serve.add_argument("--max-buffered-bytes", type=size_arg, metavar="SIZE",
                       default=parse_size(DEFAULT_MAX_BUFFERED),
                       help="budget for unread replies and partly received frames across all "
                            "connections; when spent, those over their share are closed "
                            f"(default {DEFAULT_MAX_BUFFERED})")
    serve.add_argument("--frame-timeout", type=positive_float_arg, default=DEFAULT_FRAME_TIMEOUT_S,
                       metavar="SECONDS",
                       help="a frame whose header arrived must be complete within this "
                            f"(default {DEFAULT_FRAME_TIMEOUT_S:g})")
    serve.add_argument("--idle-timeout", type=positive_float_arg, default=DEFAULT_IDLE_TIMEOUT_S,
                       metavar="SECONDS",
                       help="close a connection with nothing in flight for this long "
                            f"(default {DEFAULT_IDLE_TIMEOUT_S:g})")
    serve.add_argument("--slow-reader-timeout", type=positive_float_arg,
                       default=DEFAULT_SLOW_READER_TIMEOUT_S, metavar="SECONDS",
                       help="close a connection whose unread replies do not shrink for this "
                            f"long (default {DEFAULT_SLOW_READER_TIMEOUT_S:g})")


def limits_from_args(args: argparse.Namespace) -> Any:
    """The ConnectionLimits of the flags above; ValueError if they make no sense."""
    import resource

    from kvstore.daemon.limits import ConnectionLimits

    fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if args.max_connections is not None and fds != resource.RLIM_INFINITY \
            and args.max_connections > fds:
        raise ValueError(f"--max-connections {args.max_connections} is more than the "
                         f"{fds} open files this process may have (ulimit -n): it would "
                         "never be reached")
    return ConnectionLimits(
        max_connections=args.max_connections, max_buffered_bytes=args.max_buffered_bytes,
        frame_timeout_s=args.frame_timeout, idle_timeout_s=args.idle_timeout,
        slow_reader_timeout_s=args.slow_reader_timeout)
