"""The options of `kvengine router`: the engines, the daemon, routing; the HTTP front is shared
with `kvengine serve` (``server/http_front_args.py``)."""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit

from kvstore.cli.args import (
    positive_float_arg,
    positive_int_arg,
)
from server.http_front_args import ROUTER_FRONT, add_http_front_args
from server.model_args import ROUTER_MODEL, add_model_args
from server.router.policy import ROUTING_MODES


def _engine_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or \
            parts.fragment or parts.path not in ("", "/"):
        raise argparse.ArgumentTypeError(f"expected an engine's base URL such as "
                                         f"http://127.0.0.1:8001, got {text!r}")
    return text.rstrip("/")


def _milliseconds(text: str) -> float:
    return positive_float_arg(text) / 1000.0


def add_router_arguments(router: argparse.ArgumentParser) -> None:
    """Every option of `kvengine router`."""
    add_model_args(router, ROUTER_MODEL)
    router.add_argument("--engine", dest="engines", action="append", type=_engine_url,
                        required=True, metavar="URL",
                        help="an engine's base URL (`kvengine serve ... --kv-offload`, one per "
                        "GPU); repeat for each engine")
    router.add_argument("--kv-store-socket", default=None, metavar="PATH",
                        help="the socket of the kvstore daemon the engines share (default: "
                        "$KVSTORE_SOCKET, else the per-user default)")
    router.add_argument("--routing", choices=ROUTING_MODES, default="kv",
                        help="kv: to the engine where the first token is expected soonest: "
                        "the prompt tokens the router has queued there, plus this prompt "
                        "priced by where its blocks are (its own HBM free, a peer's HBM, DRAM, "
                        "SSD at the engine's measured restore rates, the rest at its prefill "
                        "rate), asking the daemon; round-robin: in turn; least-loaded: fewest "
                        "requests in flight (default: %(default)s)")
    router.add_argument("--kv-locate-timeout-ms", dest="kv_locate_timeout_s",
                        type=_milliseconds, default=0.05, metavar="MS",
                        help="kv: the longest a request waits for the daemon's answer; past it "
                        "(or with the daemon down) it goes to the least loaded engine "
                        "(default: 50)")
    router.add_argument("--kv-retry-interval", type=positive_float_arg, default=1.0,
                        metavar="SECONDS",
                        help="kv: after the daemon failed to answer, route by load for this long "
                        "before asking it again (default: %(default)s)")
    router.add_argument("--probe-interval", type=positive_float_arg, default=1.0, metavar="SECONDS",
                        help="how often each engine's load and readiness are read (GET /load); "
                        "an engine that is down is tried again as often (default: %(default)s)")
    router.add_argument("--probe-timeout", type=positive_float_arg, default=1.0, metavar="SECONDS",
                        help="a probe unanswered this long marks the engine down (default: "
                        "%(default)s)")
    router.add_argument("--connect-timeout", type=positive_float_arg, default=2.0,
                        metavar="SECONDS",
                        help="connecting to an engine; one that does not accept is skipped for "
                        "the next (default: %(default)s)")
    router.add_argument("--upstream-timeout", type=positive_float_arg, default=600.0,
                        metavar="SECONDS",
                        help="the longest an engine may stay silent during a request (before "
                        "its answer, between streamed bytes); past it the client gets a 504 "
                        "(default: %(default)s)")
    router.add_argument("--first-byte-timeout", type=positive_float_arg, default=30.0,
                        metavar="SECONDS",
                        help="the longest an engine may take to start a streamed answer (it "
                        "sends its response head when it admits the request); past it the "
                        "client gets a 504, so a hung engine does not hold requests for "
                        "--upstream-timeout (default: %(default)s)")
    router.add_argument("--max-upstream-connections", type=positive_int_arg, default=1024,
                        metavar="N", help="HTTP connections to the engines, all together "
                        "(default: %(default)s)")
    add_http_front_args(router, ROUTER_FRONT)
