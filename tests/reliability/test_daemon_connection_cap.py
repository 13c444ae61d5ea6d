"""Issue 32 item 4: a full connection cap locked clients out with a misleading error. With
--max-connections idle connections held, a new Client failed with "Broken pipe" (or
"Connection reset by peer") instead of the daemon's `resource_exhausted`, and kept failing
until --idle-timeout (600 s) closed an idle one.

Now the client reports the daemon's refusal frame when its send or read fails after it, and at
the cap the daemon closes the longest-idle connection that holds nothing (no lease, no
registration, idle at least 2 s) to take the new one; only when none can go is the new one
refused, with an error naming the cap.

A real `kvstore serve --max-connections 8`, real clients.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import xxhash
from daemon_helpers import RunningDaemon

from kvstore.daemon.limits import DEFAULT_RECLAIM_IDLE_S
from kvstore.keys import Namespace
from kvstore.wire.client import Client, ClientError, DaemonUnavailable

pytestmark = pytest.mark.timeout(60)

CAP = 8
NUM_REFUSED_TRIES = 6  # each way of failing; before: every put, most healths misreported


def _refusal(client: Client, action: Callable[[Client], object]) -> ClientError:
    with pytest.raises((ClientError, DaemonUnavailable)) as caught:
        action(client)
    client.close()
    assert isinstance(caught.value, ClientError), f"{type(caught.value).__name__}: " \
        f"{caught.value}"
    return caught.value


def _assert_names_the_cap(error: ClientError) -> None:
    assert error.code == "resource_exhausted", error
    assert f"maximum of {CAP} connections" in str(error), error
    assert "--max-connections" in str(error), error


def _accepted(daemon: RunningDaemon) -> Client:
    """A client the daemon took (the start-up check's connection may still be closing)."""
    give_up_at = time.monotonic() + 5.0
    while True:
        client = daemon.client(timeout_s=5.0)
        try:
            assert client.health()["status"] == "ok"
            return client
        except ClientError:
            client.close()
            if time.monotonic() > give_up_at:
                raise
            time.sleep(0.05)


def test_a_full_cap_says_so_and_idle_connections_make_room(
        make_daemon: Callable[..., RunningDaemon]) -> None:
    daemon = make_daemon("--max-connections", str(CAP))
    held = [_accepted(daemon) for _ in range(CAP)]
    # The first holds a lease: never reclaimed, idle or not.
    held[0].put(b"cap-lease", b"v")
    hit = held[0].lookup(Namespace(name="default").digest, [xxhash.xxh3_128_digest(b"cap-lease")],
                         [b"cap-lease"])
    assert hit.lease_id is not None

    # 1. All busy (each sends a request every 0.2 s): new clients are refused, and told why,
    # whether their first request is small or large enough to be cut off mid-send.
    stop = threading.Event()

    def keep_busy() -> None:
        while not stop.wait(0.2):
            for client in held:
                client.health()

    busy = threading.Thread(target=keep_busy)
    busy.start()
    try:
        started = time.monotonic()
        for _ in range(NUM_REFUSED_TRIES):
            _assert_names_the_cap(_refusal(daemon.client(timeout_s=5.0), Client.health))
            _assert_names_the_cap(_refusal(daemon.client(timeout_s=5.0),
                                           lambda c: c.put(b"k", bytes(1 << 20))))
        refused_s = (time.monotonic() - started) / (2 * NUM_REFUSED_TRIES)
    finally:
        stop.set()
        busy.join()

    # 2. All idle: each new client takes the place of the longest-idle one holding nothing,
    # at once; the one holding a lease stays, so the last new one is refused.
    time.sleep(DEFAULT_RECLAIM_IDLE_S + 0.5)
    started = time.monotonic()
    fresh = [daemon.client(timeout_s=5.0) for _ in range(CAP - 1)]
    for client in fresh:
        assert client.health()["status"] == "ok"
    took_s = time.monotonic() - started
    _assert_names_the_cap(_refusal(daemon.client(timeout_s=5.0), Client.health))
    events = fresh[0].stats()["daemon"]["events"]
    assert events["connections_reclaimed"] == CAP - 1, events
    assert held[0].health()["status"] == "ok" and held[0].release(hit.lease_id) is True
    for client in held[1:]:
        with pytest.raises(DaemonUnavailable):
            client.health()
    for client in held + fresh:
        client.close()
    daemon.stop()
    log_lines = [line for line in daemon.lines if " WARNING " in line or " ERROR " in line]
    print(f"\ncap {CAP}: a refusal in {refused_s * 1000:.0f} ms naming the cap; "
          f"{CAP - 1} new clients served in {took_s * 1000:.0f} ms by reclaiming idle "
          f"connections; {len(log_lines)} warning lines")
    assert len(log_lines) <= 2, log_lines
