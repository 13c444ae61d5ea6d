"""The one store client both engines use (``StoreClient`` over ``LinkThread``), against a real
daemon: what it registers on each connect, and that a request naming block ids goes out only on
the connection it was planned for."""

from __future__ import annotations

import signal
import time

from daemon_helpers import make_chain, start_daemon, wait_until
from support.arena import ShmArena

from kvstore import StoreState
from offload.store_client import StoreClient

BLOCK = 4096


def _restart(daemon, tmp_path):
    """Kill the daemon and start a new one on the same socket."""
    daemon.proc.kill()
    daemon.proc.wait(10)
    return start_daemon(tmp_path, socket_path=daemon.socket_path, http=False)


def _reconnected(client: StoreClient, epoch: int) -> bool:
    return client.available and client.registration_epoch > epoch


def test_a_request_planned_on_an_old_connection_never_goes_out(make_daemon, tmp_path) -> None:
    daemon = make_daemon()
    arena = ShmArena(4, BLOCK, seed=1)
    chain = make_chain("link-epoch", 2)
    client = StoreClient(daemon.socket_path, arena.layout, "epoch-test", timeout_s=2.0,
                         reconnect_interval_s=0.1)
    fresh = None
    try:
        assert client.wait_available(5.0)
        old = client.registration_epoch
        fresh = _restart(daemon, tmp_path)
        assert wait_until(lambda: _reconnected(client, old), 10.0)
        stale = client.save(chain.namespace, [0, 1], chain.hashes, chain.idents, epoch=old)
        assert stale.wait(5.0) and not stale.ok and stale.never_sent
        with fresh.client() as c:
            assert c.stats()["tiers"]["dram"]["blocks"] == 0
        current = client.save(chain.namespace, [0, 1], chain.hashes, chain.idents,
                            epoch=client.registration_epoch)
        assert current.wait(5.0) and current.ok and not current.never_sent
        assert current.result.outcomes == ["saved", "saved"]
        assert current.sent_epoch == client.registration_epoch
    finally:
        client.close()
        if fresh is not None:
            fresh.stop()
        arena.close()


def test_a_layout_made_per_connect_is_fresh_and_announced(make_daemon, tmp_path) -> None:
    daemon = make_daemon()
    arenas: list[ShmArena] = []
    announced: list[int] = []

    def fresh_layout():
        arenas.append(ShmArena(4, BLOCK))
        return arenas[-1].layout

    client = StoreClient(daemon.socket_path, fresh_layout, "per-connect", timeout_s=2.0,
                         reconnect_interval_s=0.1, connect_wait_s=0.0,
                         on_registered=lambda: announced.append(len(arenas)))
    fresh = None
    try:
        assert client.wait_available(5.0)
        assert len(arenas) == 1 and announced == [1]
        fresh = _restart(daemon, tmp_path)
        assert wait_until(lambda: _reconnected(client, 1), 10.0)
        assert len(arenas) == 2 and announced == [1, 2]
        with fresh.client() as c:
            assert c.stats()["daemon"]["registrations"] == 1
    finally:
        client.close()
        if fresh is not None:
            fresh.stop()
        for arena in arenas:
            arena.close()


def test_a_link_without_a_layout_only_looks_up(make_daemon) -> None:
    daemon = make_daemon()
    chain = make_chain("link-lookup-only", 3)
    client = StoreClient(daemon.socket_path, None, "lookup-only", timeout_s=2.0)
    try:
        assert client.wait_available(5.0)
        lookup = client.lookup(chain.namespace, chain.hashes, chain.idents, lease_ttl_s=0)
        assert lookup.wait(5.0) and lookup.ok and lookup.result.num_hit == 0
        with daemon.client() as c:
            assert c.stats()["daemon"]["registrations"] == 0
        # Nothing registered: a save names no memory; the link refuses it, never sent.
        save = client.save(chain.namespace, [0], chain.hashes[:1], chain.idents[:1])
        assert save.wait(5.0) and not save.ok and save.never_sent and not save.answered
    finally:
        client.close()


def test_a_lookup_goes_out_from_the_callers_thread_and_a_stopped_daemon_is_still_seen(
        make_daemon) -> None:
    daemon = make_daemon()
    arena = ShmArena(4, BLOCK, seed=2)
    chain = make_chain("at-once", 2)
    client = StoreClient(daemon.socket_path, arena.layout, "at-once", timeout_s=2.0,
                         reconnect_interval_s=0.1)
    try:
        assert client.wait_available(5.0)
        saved = client.save(chain.namespace, [0, 1], chain.hashes, chain.idents,
                            epoch=client.registration_epoch)
        assert saved.wait(5.0) and saved.ok
        lookup = client.lookup(chain.namespace, chain.hashes, chain.idents)
        assert client.counters["sent_at_once"] == 1  # no hop through the link's thread
        assert lookup.sent_epoch == client.registration_epoch  # on the live connection
        assert lookup.wait(5.0) and lookup.ok and lookup.result.num_hit == 2
        client.release(lookup.result.lease_id)
        # A stopped daemon: the socket still takes a lookup at once, which then gets no reply
        # (the store turns hung, the lookup fails by its deadline); never a blocked caller.
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            stuck = client.lookup(chain.namespace, chain.hashes, chain.idents)
            assert time.monotonic() - started < 0.5
            assert wait_until(lambda: client.state is StoreState.HUNG, 10.0)
            assert stuck.wait(10.0) and not stuck.ok
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
    finally:
        client.close()
        arena.close()


def _stopping_layout(daemon, arena: ShmArena, stopped: list[bool]):
    """A layout made per connect that stops the daemon as it is made: after the daemon answered
    the link's first probe, before the registration goes out."""

    def make():
        daemon.proc.send_signal(signal.SIGSTOP)
        stopped.append(True)
        return arena.layout

    return make


def _states_for(client: StoreClient, seconds: float) -> set[StoreState]:
    seen = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.add(client.state)
        time.sleep(0.02)
    return seen


def test_a_registration_slower_than_a_probe_is_not_a_hang(make_daemon) -> None:
    """A registration has its own bound: on an H200 a device new to the daemon first gets its
    CUDA context (a second or more), past a probe's deadline. A daemon that answered the
    link's first probe and then registers slowly leaves the store ``down`` (not yet connected),
    never counted hung, and ``ok`` once it answers; past the registration's bound it is hung."""
    daemon = make_daemon()
    arena = ShmArena(4, BLOCK, seed=3)
    stopped: list[bool] = []
    client = None
    try:
        client = StoreClient(daemon.socket_path, _stopping_layout(daemon, arena, stopped),
                             "slow-register", timeout_s=2.0, reconnect_interval_s=0.1,
                             connect_wait_s=0.0, register_timeout_s=10.0)
        assert wait_until(lambda: bool(stopped), 5.0)
        seen = _states_for(client, 1.5)  # twice a probe's deadline (0.75 s)
        daemon.proc.send_signal(signal.SIGCONT)
        assert seen == {StoreState.DOWN}, seen
        assert wait_until(lambda: client.available, 10.0)
        assert client.counters["store_hung"] == 0 and client.counters["connects"] == 1
        assert client.counters["connect_failures"] == 0
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        if client is not None:
            client.close()
        arena.close()


def test_a_registration_past_its_bound_and_a_daemon_that_never_answers_are_hangs(
        make_daemon) -> None:
    daemon = make_daemon()
    arena = ShmArena(4, BLOCK, seed=4)
    stopped: list[bool] = []
    clients: list[StoreClient] = []
    try:
        # Registering for longer than its 0.5 s bound.
        clients.append(StoreClient(daemon.socket_path, _stopping_layout(daemon, arena, stopped),
                                   "never-registers", timeout_s=2.0, reconnect_interval_s=5.0,
                                   connect_wait_s=0.0, register_timeout_s=0.5))
        assert wait_until(lambda: clients[0].state is StoreState.HUNG, 5.0)
        assert clients[0].counters["store_hung"] == 1
        # A daemon stopped before it answered anything: hung after a probe's deadline, as it
        # was before registrations had a bound of their own.
        clients.append(StoreClient(daemon.socket_path, arena.layout, "stopped-daemon",
                                   timeout_s=3.0, reconnect_interval_s=5.0, connect_wait_s=0.0))
        assert wait_until(lambda: clients[1].state is StoreState.HUNG, 2.5)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        for client in clients:
            client.close()
        arena.close()


def test_a_lookup_overtakes_saves_queued_before_it(make_daemon) -> None:
    """The step thread queues a step's saves, then a new request's lookup: the lookup goes out
    before the saves still queued (``LinkQueue``), so the request does not wait behind them.
    Here the link's thread is held in its first save's send (its connection's send lock taken)
    while two more saves and then the lookup are queued; the lookup goes out second."""
    daemon = make_daemon()
    arena = ShmArena(8, BLOCK, seed=5)
    chains = [make_chain(f"queued-save-{i}", 2) for i in range(3)]
    wanted = make_chain("overtaking-lookup", 2)
    client = StoreClient(daemon.socket_path, arena.layout, "overtake", timeout_s=2.0)
    try:
        assert client.wait_available(5.0)
        connection = client._thread._client  # the link's connection
        assert connection is not None
        # No health probe from here on: one due while the send lock is held would block the
        # link's thread in its send, before it takes the first save (then the lookup overtook
        # all three: CI, twice, on a loaded two-worker run).
        probe = client._thread._probe
        probe.interval_s, probe._next_at = 3600.0, time.monotonic() + 3600.0
        with connection._send_lock:  # the link's thread blocks in its first send
            saves = [client.save(c.namespace, [2 * i, 2 * i + 1], c.hashes, c.idents,
                                 epoch=client.registration_epoch)
                     for i, c in enumerate(chains)]
            # The link's thread has taken the first save and waits to send it.
            queue = client._thread._queue
            assert wait_until(lambda: len(queue) == len(saves) - 1, timeout_s=10.0)
            lookup = client.lookup(wanted.namespace, wanted.hashes, wanted.idents)
            assert client.counters["sent_at_once"] == 0  # the socket was held: it queued
        assert lookup.wait(5.0) and lookup.ok and lookup.result.num_hit == 0
        assert all(s.wait(5.0) and s.ok for s in saves)
        order = sorted([("lookup", lookup.request_id)]
                       + [(f"save-{i}", s.request_id) for i, s in enumerate(saves)],
                       key=lambda item: item[1])
        assert [name for name, _ in order] == ["save-0", "lookup", "save-1", "save-2"]
    finally:
        client.close()
        arena.close()
