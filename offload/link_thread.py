"""LinkThread: an engine's connection to the daemon, owned by a thread (kvengine's and vLLM's).

Everything that can block on the daemon happens here, never on the engine's step thread: the
connect and the registration of the KV memory, sending requests (a stopped daemon stops reading,
so a send can block once the socket buffer is full), health probes, closing. The step thread
hands requests over through a bounded queue (``LinkQueue`` of ``Outgoing``: a request and its
``Transfer`` handle) and polls the handles. A lookup goes out from the caller's thread at once if
the socket takes it without blocking (``LinkRequest.send_nowait``), whatever is queued: it names
no memory, so it may overtake saves and publications (``link_queue``), and a request's arrival
then waits for no thread hop, nor for the saves of the step before, before it is on the wire.
When the link's thread holds the socket, the lookup queues ahead of everything but other
lookups (``LinkRequest.urgent``). Measured on one H200 (``benchmarks.first_turn_cost``): a first
turn arriving right after another request's 2,048-token prefill waited for its lookup behind
that prefill's saves and lost a step.

The state the engine reads (``state``, a ``StoreState`` told by its rule ``while_waiting``): ``ok``
(registered, the last probe answered in time), ``hung`` (a probe or a send has waited on the daemon
longer than the deadline, and nothing at all came back meanwhile: it is alive enough to hold the
socket but does not answer, as under SIGSTOP; the deadline is ``probe_deadline_s``, longer where
recent probes were slow: ``StoreProbe``; a registration, sent once the daemon has answered a first
probe on the new connection, has its own bound, ``register_timeout_s``) or ``down`` (not connected,
the registration still running included). It is derived from timestamps, so it is right even while
this thread itself is stuck in a send. A lost connection is made again on demand (a request, or the
engine asking whether the store is available), at most once per ``reconnect_interval_s``; each new
connection bumps ``epoch``: the daemon met again may have lost what it held, and a request that
names registered memory (``Outgoing.epoch``) is sent only on the connection it was planned for.

What is registered: a fixed ``KVLayout`` (kvengine's arena), a callable that makes a fresh one
on every connect (vLLM's CPU staging buffer, so a daemon that wakes up late writes only into
memory nobody reads), or nothing (vLLM's scheduler side, which only looks up). CPU memory is
registered by file descriptor (``KVLayout.fds``, sent with the frame): each registration sends
fresh duplicates, so a daemon met again maps the same memory from descriptors of its own.
``on_registered`` runs once each registration has been answered or given up. What a new
connection does before it carries requests (the registration, the key filter) is ``LinkSetup``'s.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvstore import Client, ClientError, DaemonUnavailable, KeyFilterView, StoreState
from offload.link_queue import LinkQueue, QueueFull
from offload.link_requests import LinkRequest
from offload.link_setup import LinkSetup
from offload.store_probe import PROBE_DEADLINE_S, PROBE_INTERVAL_S, StoreProbe
from offload.transfer import Transfer
from offload.vocab import KVLayout

log = logging.getLogger("offload")
# Connected, reconnected: its own logger, which the programs show at their default level.
connection_log = logging.getLogger("offload.connection")

# Requests waiting for the link's thread; past this the store is too far behind: refused.
MAX_QUEUED = 4096
# The link's thread wakes at least this often (probes, reconnects, closing).
_TICK_S = 0.05
# Taken off what is left of a copy's deadline when the link sends it: the daemon's copy must
# stop (and its last chunk land) before the engine, at its own deadline, reuses the blocks.
SEND_MARGIN_S = 0.1


def _finish_in_a_thread(complete: Callable[[], None]) -> None:
    """The rest of a frame the socket took in part: written by a thread of its own, which may
    block (rare: a lookup is a few KB)."""
    threading.Thread(target=complete, name="kv-offload-send-rest", daemon=True).start()


@dataclass(frozen=True)
class Outgoing:
    """One request queued for the link's thread and the handle it completes. With ``epoch``,
    it goes out only on that connection (its block ids belong to that registration)."""

    request: LinkRequest
    transfer: Transfer
    epoch: int | None = None


class LinkThread:
    """A thread that owns the client, the registration and the health of one engine's store."""

    def __init__(self, socket_path: str | Path | None,
                 layout: KVLayout | Callable[[], KVLayout] | None, engine_id: str,
                 timeout_s: float, reconnect_interval_s: float, counters: Counter[str],
                 probe_interval_s: float = PROBE_INTERVAL_S,
                 probe_deadline_s: float = PROBE_DEADLINE_S, max_queued: int = MAX_QUEUED,
                 register_timeout_s: float | None = None,
                 on_registered: Callable[[], None] | None = None) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.register_timeout_s = timeout_s if register_timeout_s is None else register_timeout_s
        self.reconnect_interval_s = reconnect_interval_s
        self.probe_deadline_s = probe_deadline_s
        self.counters = counters
        for key in ("connects", "connect_failures", "probes", "sent_at_once"):  # made now
            counters[key] += 0
        self.epoch = 0  # connections made; a new one starts with nothing published
        self._probe = StoreProbe(counters, probe_interval_s, probe_deadline_s)
        self._queue: LinkQueue[Outgoing] = LinkQueue(max_queued)
        self._client: Client | None = None
        self._registration_id: int | None = None
        # The connected daemon's key filter, mapped (None: it has none, or it is not
        # authoritative, or it could not be read): a hash it lacks is held by no tier.
        self.key_filter: KeyFilterView | None = None
        self._up = False  # connected (and registered, if there is a layout)
        self._busy_since: float | None = None  # this thread waits on the daemon since then
        self._registering_since: float | None = None  # a registration runs since then
        self._next_attempt = 0.0
        self._connect_wanted = threading.Event()
        self._drop_wanted = threading.Event()
        self._first_attempt_done = threading.Event()
        self._closing = threading.Event()
        self._setup = LinkSetup(layout, engine_id, self.register_timeout_s, counters,
                                self._closing, on_registered)
        self._connect_wanted.set()  # the first connect is wanted at once
        self._thread = threading.Thread(target=self._run, name="kv-offload-link", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------

    @property
    def state(self) -> StoreState:
        """OK, HUNG or DOWN (see the module docstring); never blocks. A wait past the deadline
        is a hang only while no reply of any kind has arrived for that long either: a daemon
        that still answers other requests is slow, not stopped."""
        registering = self._registering_since
        if registering is not None:
            # The daemon answered our first request and is registering us: that maps the
            # engine's memory, and on a device new to the daemon first makes its CUDA context
            # (a second or more on an H200), so it has its own bound, not a probe's.
            return StoreState.while_waiting(None, (registering,), self.register_timeout_s,
                                            connected=False)
        return StoreState.while_waiting(self._client, (self._busy_since, self._probe.sent_at),
                                        self.deadline_s, connected=self._up)

    def daemon_knows(self, verb: str) -> bool:
        """Whether the daemon of the connection now has ``verb`` (its hello's protocol)."""
        client = self._client
        return client is not None and client.knows_verb(verb)

    @property
    def deadline_s(self) -> float:
        """How long a wait on the daemon may last before it counts as hung: ``probe_deadline_s``,
        or more where recent probes took longer (``StoreProbe.deadline_s``)."""
        return self._probe.deadline_s

    @property
    def daemon_pid(self) -> int | None:
        """The daemon's pid, from the last health answer."""
        return self._probe.daemon_pid

    def wait_first_attempt(self, timeout_s: float) -> None:
        """Let a caller give the first connect a moment (bounded) before it starts serving."""
        self._first_attempt_done.wait(timeout_s)

    def want_connect(self) -> None:
        """Reconnect soon if not connected (rate-limited, on this link's thread)."""
        self._connect_wanted.set()

    def want_drop(self) -> None:
        """Close the connection (a request got no reply by its deadline); reconnect on demand."""
        self._drop_wanted.set()

    def submit(self, outgoing: Outgoing) -> bool:
        """Queue a request (or send it at once, see the module docstring); False
        (``outgoing`` untouched) if the queue is full or closing."""
        if self._closing.is_set():
            return False
        if self._send_at_once(outgoing):
            self._connect_wanted.set()  # as for a queued one: lost, the link comes back at once
            return True
        try:
            self._queue.put(outgoing, urgent=outgoing.request.urgent)
        except QueueFull:
            return False
        self._connect_wanted.set()
        return True

    def _send_at_once(self, outgoing: Outgoing) -> bool:
        """Send from the caller's thread without blocking; False to queue it instead. Only on
        a live connection, and only what may overtake the queue (``LinkRequest.urgent``:
        lookups, which name no memory).
        The client is read before the epoch: a connection made in between labels the request
        with the new epoch while it went out on the old, closed connection, where it fails;
        never a lease of the live connection labelled as an older one's."""
        client = self._client
        epoch = self.epoch
        if (client is None or not self._up or outgoing.epoch is not None
                or not outgoing.request.urgent):
            return False
        try:
            pending = outgoing.request.send_nowait(client, _finish_in_a_thread)
        except Exception:  # a broken connection, a frame too large: the link's thread decides
            return False
        if pending is None:
            return False
        outgoing.transfer.attach(pending, epoch, client.daemon_process)
        self.counters["sent_at_once"] += 1
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Unregister (bounded), close the connection and stop the thread. Idempotent."""
        self._closing.set()
        self._queue.wake()
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # stuck in a send to a stopped daemon: cut the socket
            client = self._client
            if client is not None:
                client.close()
            self._thread.join(1.0)

    # -- the link's thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                self._maintain()
                outgoing = self._queue.get(_TICK_S)
                if outgoing is not None:
                    self._send(outgoing)
        finally:
            self._shutdown()

    def _maintain(self) -> None:
        if self._client is not None and (self._client.is_closed or self._drop_wanted.is_set()):
            self._drop()
        self._drop_wanted.clear()
        if self._client is None and self._connect_wanted.is_set():
            self._connect()
        if self._client is not None:
            self._probe_step()

    def _send(self, outgoing: Outgoing) -> None:
        if self._client is None:
            self._connect()
        client, registration_id = self._client, self._registration_id
        if client is None or not self._up or outgoing.epoch not in (None, self.epoch):
            outgoing.transfer.abandon()
            return
        # A copy's daemon gets what is left of the engine's wait, less a margin: past it the
        # engine takes its blocks back, and a copy started then would move reused memory.
        left_s = None
        if outgoing.request.copies:
            left_s = outgoing.transfer.remaining_s() - SEND_MARGIN_S
            if left_s <= 0:
                outgoing.transfer.abandon()  # too late to send: never sent, nothing to undo
                return
        self._busy_since = time.monotonic()
        try:
            outgoing.transfer.attach(outgoing.request.send(client, registration_id, left_s),
                                     self.epoch, client.daemon_process)
        except (DaemonUnavailable, ClientError, OSError):
            outgoing.transfer.abandon()
            self._drop()
        except ValueError:  # a request this link cannot carry (no registration): refused
            outgoing.transfer.abandon()
        finally:
            self._busy_since = None

    def _connect(self) -> None:
        now = time.monotonic()
        if now < self._next_attempt:
            return
        self._next_attempt = now + self.reconnect_interval_s
        self._connect_wanted.clear()
        self._busy_since = now
        client = None
        connected = False
        try:
            client = Client(self.socket_path, timeout_s=self.timeout_s)
            # The daemon answers first (the hello and a health probe, judged as any wait is: a
            # stopped daemon is hung after a probe's deadline); only then the registration,
            # under its own bound.
            self._setup.wait(client.health_async(self.timeout_s), self.timeout_s)
            self._busy_since, self._registering_since = None, time.monotonic()
            registration_id = self._setup.register(client)
            key_filter = self._setup.open_key_filter(client)
            connected = True
        except (DaemonUnavailable, ClientError, OSError) as exc:
            if client is not None:
                client.close()
            if self.counters["connect_failures"] == 0:
                log.warning("kv offload: store not available (%s); serving without it and "
                            "retrying every %.1f s", exc, self.reconnect_interval_s)
            self.counters["connect_failures"] += 1
            return
        finally:
            self._busy_since = self._registering_since = None
            if not connected:
                self._first_attempt_done.set()
        self.epoch += 1  # before ``_up``: a request planned on the old connection never goes out
        self.key_filter = key_filter
        self._client, self._registration_id = client, registration_id
        self._up = True
        self._first_attempt_done.set()  # after ``_up``: a waiter then finds the store available
        self.counters["connects"] += 1
        self._probe.start_over(time.monotonic())
        where = client.socket_path
        if self.counters["connects"] > 1:
            connection_log.warning("kv offload: reconnected to kvstore at %s (registration %s)",
                                   where, registration_id)
        else:
            connection_log.info("kv offload: connected to kvstore at %s (registration %s)",
                                where, registration_id)

    def _probe_step(self) -> None:
        assert self._client is not None
        now = time.monotonic()
        self._probe.collect(self._client, now)
        if not self._probe.due(now):
            return
        self._busy_since = now
        try:
            self._probe.sent(self._client.health_async(self.timeout_s), now)
        except (DaemonUnavailable, ClientError, OSError):
            self._drop()
        finally:
            self._busy_since = None

    def _drop(self) -> None:
        self._up = False
        client, self._client, self._registration_id = self._client, None, None
        self.key_filter = None  # the next daemon's, if any, comes with the next connection
        self._probe.start_over(time.monotonic())
        if client is not None:
            log.warning("kv offload: lost the store; recomputing until it is back")
            client.close()

    def _shutdown(self) -> None:
        """Give back what is queued, unregister (bounded) and close."""
        for outgoing in self._queue.take_all():
            outgoing.transfer.abandon()
        client, registration_id = self._client, self._registration_id
        if client is None:
            return
        if registration_id is not None and not client.is_closed:
            with contextlib.suppress(DaemonUnavailable, ClientError, OSError):
                client.unregister_async(registration_id, 2.0).wait(2.0)
        self._up = False
        self._client = self._registration_id = None
        client.close()
