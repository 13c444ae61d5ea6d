"""Cluster settings: where Redis is, who this node is, where peers reach it; validated once.

``kvstore serve --cluster redis://HOST:PORT/DB --node-id ID --listen HOST:PORT --advertise
HOST:PORT`` becomes one ``ClusterConfig`` through ``ClusterConfig.from_args``.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

_NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_KEY_PREFIX_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_UNSPECIFIED_HOSTS = ("0.0.0.0", "::", "")


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` into (host, port); ValueError naming ``what`` otherwise."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"{what} must be HOST:PORT or [IPv6]:PORT, got {text!r}")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"{what} must be HOST:PORT (IPv6 as [ADDR]:PORT), got {text!r}")
    if not host:
        raise ValueError(f"{what} needs a host, got {text!r}")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{what} port must be an integer in 0..65535, got {port_text!r}")
    return host, int(port_text)


def format_host_port(host: str, port: int) -> str:
    """The inverse of ``parse_host_port``: IPv6 hosts get brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def default_node_id() -> str:
    """This machine's host name, cut to what a node id may hold."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64].lstrip("._-")
    return name or "node"


@dataclass(frozen=True)
class ClusterConfig:
    """One node's cluster settings. ``listen_port`` 0 takes a free port; the advertised port then
    follows it (``advertise_port`` 0). Timeouts are seconds.
    """

    redis_url: str
    node_id: str
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    advertise_host: str | None = None  # None: the listen host
    advertise_port: int = 0  # 0: the port actually listened on
    heartbeat_interval_s: float = 1.0
    node_ttl_s: float = 5.0  # a node that stops heartbeating drops out after this
    remote_timeout_s: float = 2.0  # the deadline of one remote fetch, connect included
    redis_timeout_s: float = 0.5  # socket timeout of every Redis call: a paused Redis is bounded
    flush_interval_s: float = 0.005  # how long index writes may wait to share a pipeline
    flush_max_batch: int = 4096  # index writes per script call
    max_pending_events: int = 1 << 20  # index writes kept while Redis is away; oldest dropped
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    key_prefix: str = "kvstore"
    max_blocks_per_fetch: int = 4096
    max_block_bytes: int = 1 << 30
    endpoints_per_peer: int = 4
    suspect_s: float | None = None  # how long an unreachable peer is skipped; None: node_ttl_s

    def __post_init__(self) -> None:
        parts = urlsplit(self.redis_url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"--cluster must be redis://HOST:PORT/DB, got {self.redis_url!r}")
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"--cluster has a bad port: {self.redis_url!r}") from None
        if not parts.hostname or port is None:
            raise ValueError(f"--cluster must name HOST and PORT: redis://HOST:PORT/DB, "
                             f"got {self.redis_url!r}")
        db_text = parts.path.lstrip("/")
        if db_text and not db_text.isdigit():
            raise ValueError(f"--cluster database must be an integer, got {db_text!r}")
        if not _NODE_ID_RE.match(self.node_id):
            raise ValueError("--node-id must be 1-64 of [A-Za-z0-9._-] starting with a letter or "
                             f"digit, got {self.node_id!r}")
        if not self.listen_host:
            raise ValueError("--listen needs a host")
        for name in ("listen_port", "advertise_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in 0..65535")
        if self.advertise_host is None:
            if self.listen_host in _UNSPECIFIED_HOSTS:
                raise ValueError("--listen on a wildcard address needs --advertise HOST:PORT")
            object.__setattr__(self, "advertise_host", self.listen_host)
        if self.advertise_host in _UNSPECIFIED_HOSTS:
            raise ValueError(f"--advertise must be an address peers can reach, "
                             f"got {self.advertise_host!r}")
        for name in ("heartbeat_interval_s", "node_ttl_s", "remote_timeout_s", "redis_timeout_s",
                     "backoff_initial_s", "backoff_max_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.node_ttl_s < 2 * self.heartbeat_interval_s:
            raise ValueError("node_ttl_s must be at least twice heartbeat_interval_s")
        if self.flush_interval_s < 0:
            raise ValueError("flush_interval_s must be >= 0")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be >= backoff_initial_s")
        for name in ("flush_max_batch", "max_pending_events", "max_blocks_per_fetch",
                     "max_block_bytes", "endpoints_per_peer"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not _KEY_PREFIX_RE.match(self.key_prefix):
            raise ValueError(f"key_prefix must be 1-64 of [A-Za-z0-9._:-], got {self.key_prefix!r}")
        if self.suspect_s is None:
            object.__setattr__(self, "suspect_s", self.node_ttl_s)
        elif self.suspect_s < 0:
            raise ValueError("suspect_s must be >= 0")

    @classmethod
    def from_args(cls, cluster: str, node_id: str | None = None, listen: str | None = None,
                  advertise: str | None = None, **options: object) -> ClusterConfig:
        """Build from the CLI strings; ``listen`` defaults to ``127.0.0.1:0``."""
        listen_host, listen_port = parse_host_port(listen or "127.0.0.1:0", "--listen")
        advertise_host, advertise_port = None, 0
        if advertise is not None:
            advertise_host, advertise_port = parse_host_port(advertise, "--advertise")
        return cls(redis_url=cluster, node_id=node_id or default_node_id(),
                   listen_host=listen_host, listen_port=listen_port,
                   advertise_host=advertise_host, advertise_port=advertise_port,
                   **options)  # type: ignore[arg-type]

    @property
    def redis_host(self) -> str:
        return urlsplit(self.redis_url).hostname or ""

    @property
    def redis_port(self) -> int:
        return urlsplit(self.redis_url).port or 0

    @property
    def redis_db(self) -> int:
        db_text = urlsplit(self.redis_url).path.lstrip("/")
        return int(db_text) if db_text else 0

    def advertise_addr(self, bound_port: int) -> str:
        """The ``HOST:PORT`` peers dial, given the port the listener actually bound."""
        return format_host_port(self.advertise_host or self.listen_host,
                                self.advertise_port or bound_port)
