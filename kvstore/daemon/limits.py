"""What one daemon lets its clients hold: connections, buffered bytes, time without progress.

Backpressure per connection (a bounded number of requests in flight) does not bound the
daemon: many connections that each pipeline large ``get``s without reading, or send most of a
large frame and stall, add up. These limits are global (``max_buffered_bytes`` across every
connection's unread replies and partly received frames), per connection (its share of that
budget), and in time (a frame must arrive, a reader must read, an idle connection goes).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

DEFAULT_MAX_BUFFERED_BYTES = 1 << 30
DEFAULT_FRAME_TIMEOUT_S = 30.0
DEFAULT_IDLE_TIMEOUT_S = 600.0
DEFAULT_SLOW_READER_TIMEOUT_S = 10.0
DEFAULT_RECLAIM_IDLE_S = 2.0
_MAX_CONNECTIONS_CEILING = 4096


def default_max_connections() -> int:
    """Half the process's soft fd limit (at most 4,096): the other half stays for the SSD
    tier's files, the admin HTTP app and its clients, and the cluster's sockets."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _MAX_CONNECTIONS_CEILING
    return max(1, min(_MAX_CONNECTIONS_CEILING, soft // 2))


@dataclass(frozen=True)
class ConnectionLimits:
    """``max_connections``: None means ``default_max_connections()`` at start.

    ``max_buffered_bytes``: replies written but not yet read by their client, plus bodies of
    frames being received, across all connections. When it is reached, a connection holding
    more than its share (the budget over the connections holding any) is closed, and a large
    frame waits for room (at most ``frame_timeout_s``, then it is refused).
    ``frame_timeout_s``: a frame whose header arrived must be complete within it.
    ``idle_timeout_s``: a connection with nothing in flight and nothing sent for this long is
    closed. ``slow_reader_timeout_s``: one whose unread replies do not shrink for this long is.
    ``reclaim_idle_s``: at ``max_connections``, a connection idle this long (nothing in flight,
    nothing sent) that holds no lease and no registration may be closed to take a new one in
    its place, the longest idle first; younger ones are never taken (a burst of new clients
    cannot push each other out).
    """

    max_connections: int | None = None
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES
    frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    slow_reader_timeout_s: float = DEFAULT_SLOW_READER_TIMEOUT_S
    reclaim_idle_s: float = DEFAULT_RECLAIM_IDLE_S

    def __post_init__(self) -> None:
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.max_buffered_bytes < 1 << 20:
            raise ValueError(f"max_buffered_bytes must be at least 1 MiB, got "
                             f"{self.max_buffered_bytes}")
        for name in ("frame_timeout_s", "idle_timeout_s", "slow_reader_timeout_s",
                     "reclaim_idle_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def connection_cap(self) -> int:
        return self.max_connections or default_max_connections()

    @property
    def max_registered_connections(self) -> int:
        """Connections that may hold engine registrations at once: half the cap. A connection
        that holds one is never reclaimed, so without this bound a client of the same uid that
        registered a small arena on every connection locked new clients out until the idle
        timeout; with it, half the cap stays reclaimable."""
        return max(1, self.connection_cap // 2)
