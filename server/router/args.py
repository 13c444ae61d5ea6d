"""The options of `kvengine router`: the engines, the daemon, routing; the HTTP front is shared
with `kvengine serve` (``server/http_front_args.py``)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvstore.cli.args import (
    positive_float_arg,
    positive_int_arg,
)
from server.http_front_args import ROUTER_FRONT, add_http_front_args
from server.model_args import ROUTER_MODEL, add_model_args
from server.router.engine_pool import ENGINE_KINDS
from server.router.policy import ROUTING_MODES

_ENGINE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ENGINE_HEADER_MODES = ("name", "url", "off")


@dataclass(frozen=True)
class EngineAddress:
    """An ``--engine``: its base URL and the name clients see (None: its position)."""

    url: str
    name: str | None = None


def _engine_url(text: str) -> EngineAddress:
    name, sep, url = text.partition("=")
    if not sep or "://" in name:
        name, url = "", text
    elif not _ENGINE_NAME.match(name):
        raise argparse.ArgumentTypeError(f"an engine's name is 1-64 letters, digits, '.', '_' "
                                         f"or '-', got {name!r}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or \
            parts.fragment or parts.path not in ("", "/"):
        raise argparse.ArgumentTypeError(f"expected an engine's base URL such as "
                                         f"http://127.0.0.1:8001 (or NAME=URL), got {text!r}")
    return EngineAddress(url.rstrip("/"), name or None)


def engine_names(engines: list[EngineAddress]) -> dict[str, str]:
    """Each engine's URL to the name clients see (its own, else its position from 0);
    ValueError for a URL or a name given twice."""
    names: dict[str, str] = {}
    for index, engine in enumerate(engines):
        if engine.url in names:
            raise ValueError(f"--engine {engine.url} is given twice")
        names[engine.url] = engine.name or str(index)
    if len(set(names.values())) != len(names):
        raise ValueError("two --engine share a name")
    return names


@dataclass(frozen=True)
class EventsAddress:
    """A ``--kv-events``: the engine (its name or position), its vLLM KV event publisher, and
    the publisher's replay socket if it has one."""

    engine: str
    endpoint: str
    replay_endpoint: str | None = None


_ZMQ_ENDPOINT = re.compile(r"^(tcp://[^\s,]+:\d+|ipc://[^\s,]+)$")


def _events_address(text: str) -> EventsAddress:
    name, sep, rest = text.partition("=")
    endpoint, comma, replay = rest.partition(",")
    if not sep or not _ENGINE_NAME.match(name) or not _ZMQ_ENDPOINT.match(endpoint) or \
            (comma and not _ZMQ_ENDPOINT.match(replay)):
        raise argparse.ArgumentTypeError(
            f"expected ENGINE=ENDPOINT[,REPLAY_ENDPOINT] with ZMQ endpoints such as "
            f"0=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558 (vLLM's kv-events-config endpoint and "
            f"replay_endpoint, as this router reaches them), got {text!r}")
    return EventsAddress(name, endpoint, replay or None)


def events_by_url(engines: list[EngineAddress],
                  events: list[EventsAddress]) -> dict[str, EventsAddress]:
    """Each ``--kv-events`` by the URL of the engine it names; ValueError for an unknown
    engine or one named twice."""
    urls = {name: url for url, name in engine_names(engines).items()}
    out: dict[str, EventsAddress] = {}
    for address in events:
        url = urls.get(address.engine)
        if url is None:
            raise ValueError(f"--kv-events {address.engine}=...: no --engine has that name "
                             f"(names: {', '.join(urls)})")
        if url in out:
            raise ValueError(f"--kv-events names engine {address.engine} twice")
        out[url] = address
    return out


def _milliseconds(text: str) -> float:
    return positive_float_arg(text) / 1000.0


def add_router_arguments(router: argparse.ArgumentParser) -> None:
    """Every option of `kvengine router`."""
    add_model_args(router, ROUTER_MODEL)
    router.add_argument("--engine", dest="engines", action="append", type=_engine_url,
                        required=True, metavar="[NAME=]URL",
                        help="an engine's base URL (`kvengine serve ... --kv-offload`, one per "
                        "GPU), with the name clients see in front (default: its position, "
                        "from 0); repeat for each engine")
    router.add_argument("--engine-header", choices=ENGINE_HEADER_MODES, default="name",
                        help="what the x-kvengine-engine response header says about the engine "
                        "that answered: its name, its URL (internal addresses: for benchmarks "
                        "and debugging), or nothing (default: %(default)s)")
    router.add_argument("--engine-kind", choices=ENGINE_KINDS, default="auto",
                        help="what the engines are: kvengine (probed on GET /load), vllm "
                        "(load from its /metrics, HBM from its KV events: --kv-events), or auto: "
                        "an engine without /load is taken for vLLM (default: %(default)s)")
    router.add_argument("--kv-events", dest="kv_events", action="append", default=[],
                        type=_events_address, metavar="ENGINE=ENDPOINT[,REPLAY]",
                        help="vLLM engines: where an engine's KV event publisher is (vLLM's "
                        "--kv-events-config endpoint, and its replay_endpoint to recover "
                        "missed events), for kv routing by what it holds in HBM; ENGINE is its "
                        "name or position; repeat for each engine")
    router.add_argument("--kv-store-socket", default=None, metavar="PATH",
                        help="the socket of the kvstore daemon the engines share (default: "
                        "$KVSTORE_SOCKET, else the per-user default)")
    router.add_argument("--routing", choices=ROUTING_MODES, default="kv",
                        help="kv: to the engine where the first token is expected soonest: "
                        "the work (prefill, restores) the router has queued there, plus this "
                        "prompt priced by where its blocks are (its own HBM free, a peer's HBM, "
                        "DRAM, SSD at the engine's measured restore rates, the rest at its "
                        "prefill rate), asking the daemon; round-robin: in turn; least-loaded: "
                        "fewest requests in flight (default: %(default)s)")
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
