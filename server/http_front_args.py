"""The HTTP-front options `kvengine serve` and `kvengine router` share: listening, keys, limits.

One definition for both programs (the same names, types, defaults and environment variables);
only the help of the options whose meaning differs between an engine and the router in front of
it comes from the program's ``FrontHelp``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from kvstore.cli.args import port_arg, positive_float_arg, positive_int_arg
from server.settings import DEFAULT_MAX_REQUEST_BODY_BYTES

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
API_KEY_ENV = "KVENGINE_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own, read after ours
METRICS_KEY_ENV = "KVENGINE_METRICS_KEY"


@dataclass(frozen=True)
class FrontHelp:
    """The help texts that differ between the programs (the defaults are appended here)."""

    api_key: str
    metrics_key: str
    max_request_body_bytes: str
    own_logs: str  # whose logs --log-level sets besides uvicorn's


ENGINE_FRONT = FrontHelp(
    api_key="require 'Authorization: Bearer KEY'; repeat for several keys, each its own cache "
    "tenant",
    metrics_key="the operator's key for GET /metrics, which shows every tenant's traffic",
    max_request_body_bytes="larger request bodies get a 413 before they are parsed",
    own_logs="kvengine's own logs (engine, offload, server)")

ROUTER_FRONT = FrontHelp(
    api_key="the keys the engines were given: the router checks them as the engines do, passes "
    "them on, and keys each tenant's prefixes as the engines do",
    metrics_key="the operator's key for the router's GET /metrics",
    max_request_body_bytes="larger request bodies get a 413, as from the engines; give the "
    "engines' value",
    own_logs="the router's own logs")


def add_http_front_args(parser: argparse.ArgumentParser, who: FrontHelp) -> None:
    """Add the shared HTTP-front options to ``parser``, as one group of its --help."""
    front = parser.add_argument_group("HTTP front", "listening, keys, limits and logs (the same "
                                      "options for kvengine serve and kvengine router)")
    front.add_argument("--host", default="127.0.0.1", help="address to listen on")
    front.add_argument("--port", type=port_arg, default=8000,
                       help="port to listen on; 0 picks a free one")
    front.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help=f"{who.api_key} (default: ${API_KEY_ENV}, else ${VLLM_API_KEY_ENV}, "
                       "else no key)")
    front.add_argument("--metrics-key", default=None, metavar="KEY",
                       help=f"{who.metrics_key} (default: ${METRICS_KEY_ENV}; with --api-key and "
                       "no metrics key /metrics is refused, without --api-key it is open)")
    front.add_argument("--max-request-body-bytes", type=positive_int_arg,
                       default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                       help=f"{who.max_request_body_bytes} (default: %(default)s = 4 MiB)")
    front.add_argument("--max-connections", type=positive_int_arg, default=1024,
                       help="open client connections; more are refused with a 503 at once "
                       "(default: %(default)s, lowered to fit the open-file limit)")
    front.add_argument("--timeout-keep-alive", type=positive_float_arg, default=5.0,
                       metavar="SECONDS",
                       help="close a client connection that sends nothing for this long "
                       "(default: %(default)s)")
    front.add_argument("--request-read-timeout", type=positive_float_arg, default=30.0,
                       metavar="SECONDS",
                       help="close a connection whose request (headers and body) is not all "
                       "there this long after it began, with a 408 (default: %(default)s)")
    front.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                       help=f"level of {who.own_logs} and, unless --uvicorn-log-level is given, "
                       "of uvicorn's (stderr)")
    front.add_argument("--uvicorn-log-level", default=None, choices=(*LOG_LEVELS, "trace"),
                       help="level of uvicorn's logs (default: --log-level); info and below "
                       "log every request")


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The --api-key values, else $KVENGINE_API_KEY, else $VLLM_API_KEY (one key: what a
    migrated vLLM deployment sets), else none."""
    if args.api_key:
        return tuple(args.api_key)
    from_env = os.environ.get(API_KEY_ENV) or os.environ.get(VLLM_API_KEY_ENV, "")
    return (from_env,) if from_env else ()


def metrics_key(args: argparse.Namespace) -> str | None:
    """--metrics-key, else $KVENGINE_METRICS_KEY, else None."""
    return args.metrics_key or os.environ.get(METRICS_KEY_ENV) or None
