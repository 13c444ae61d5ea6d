"""The one store link both engines use (``OffloadConnector`` over ``StoreLink``), against a real
daemon: what it registers on each connect, and that a request naming block ids goes out only on
the connection it was planned for."""

from __future__ import annotations

from daemon_helpers import make_chain, start_daemon, wait_until
from support.arena import ShmArena

from offload.connector import OffloadConnector

BLOCK = 4096


def _restart(daemon, tmp_path):
    """Kill the daemon and start a new one on the same socket."""
    daemon.proc.kill()
    daemon.proc.wait(10)
    return start_daemon(tmp_path, socket_path=daemon.socket_path, http=False)


def _reconnected(conn: OffloadConnector, epoch: int) -> bool:
    return conn.available and conn.registration_epoch > epoch


def test_a_request_planned_on_an_old_connection_never_goes_out(make_daemon, tmp_path) -> None:
    daemon = make_daemon()
    arena = ShmArena(4, BLOCK, seed=1)
    chain = make_chain("link-epoch", 2)
    conn = OffloadConnector(daemon.socket_path, arena.layout, "epoch-test", timeout_s=2.0,
                            reconnect_interval_s=0.1)
    fresh = None
    try:
        assert conn.wait_available(5.0)
        old = conn.registration_epoch
        fresh = _restart(daemon, tmp_path)
        assert wait_until(lambda: _reconnected(conn, old), 10.0)
        stale = conn.save(chain.namespace, [0, 1], chain.hashes, chain.idents, epoch=old)
        assert stale.wait(5.0) and not stale.ok and stale.never_sent
        with fresh.client() as c:
            assert c.stats()["tiers"]["dram"]["blocks"] == 0
        current = conn.save(chain.namespace, [0, 1], chain.hashes, chain.idents,
                            epoch=conn.registration_epoch)
        assert current.wait(5.0) and current.ok and not current.never_sent
        assert current.result.outcomes == ["saved", "saved"]
        assert current.sent_epoch == conn.registration_epoch
    finally:
        conn.close()
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

    conn = OffloadConnector(daemon.socket_path, fresh_layout, "per-connect", timeout_s=2.0,
                            reconnect_interval_s=0.1, connect_wait_s=0.0,
                            on_registered=lambda: announced.append(len(arenas)))
    fresh = None
    try:
        assert conn.wait_available(5.0)
        assert len(arenas) == 1 and announced == [1]
        fresh = _restart(daemon, tmp_path)
        assert wait_until(lambda: _reconnected(conn, 1), 10.0)
        assert len(arenas) == 2 and announced == [1, 2]
        with fresh.client() as c:
            assert c.stats()["daemon"]["registrations"] == 1
    finally:
        conn.close()
        if fresh is not None:
            fresh.stop()
        for arena in arenas:
            arena.close()


def test_a_link_without_a_layout_only_looks_up(make_daemon) -> None:
    daemon = make_daemon()
    chain = make_chain("link-lookup-only", 3)
    conn = OffloadConnector(daemon.socket_path, None, "lookup-only", timeout_s=2.0)
    try:
        assert conn.wait_available(5.0)
        lookup = conn.lookup(chain.namespace, chain.hashes, chain.idents, lease_ttl_s=0)
        assert lookup.wait(5.0) and lookup.ok and lookup.result.num_hit == 0
        with daemon.client() as c:
            assert c.stats()["daemon"]["registrations"] == 0
        # Nothing registered: a save names no memory; the link refuses it, never sent.
        save = conn.save(chain.namespace, [0], chain.hashes[:1], chain.idents[:1])
        assert save.wait(5.0) and not save.ok and save.never_sent and not save.answered
    finally:
        conn.close()
