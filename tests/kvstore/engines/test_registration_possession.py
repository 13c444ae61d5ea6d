"""A registration proves possession of the memory it names, and holds it alone while it lives.

Against a real daemon: memory named by a shared-memory name is refused whatever the name; memory
that could shrink under a copy, or that the sender may not write, is refused; the same memory
registered again while a registration holds it is refused, whether the second registration sends
a duplicate of the descriptor or one reopened through /proc (as any process of the same uid may
do), from the same connection or another, and goes again once the first is gone. The registry's
bound on what one connection keeps mapped is checked on the registry itself.
"""

from __future__ import annotations

import dataclasses
import mmap
import os

import pytest
from daemon_helpers import RunningDaemon, make_chain, wait_until
from support.arena import ShmArena

from kvstore.engines.registration import RegistryError
from kvstore.engines.registry import Registry
from kvstore.layout import KVLayout, Region
from kvstore.wire.client import ClientError
from offload.anon_memory import AnonymousMemory

NUM_BLOCKS, BLOCK_BYTES = 8, 4096


def _refused(client, layout: KVLayout, code: str, text: str) -> None:
    with pytest.raises(ClientError) as info:
        client.register(layout, "e")
    assert info.value.code == code and text in info.value.message, info.value


def test_memory_named_by_name_is_refused(daemon: RunningDaemon, arenas: list[ShmArena]) -> None:
    arena = ShmArena(NUM_BLOCKS, BLOCK_BYTES, 1, generations=True)
    arenas.append(arena)
    region = Region("kvengine_1_000000000000", NUM_BLOCKS * BLOCK_BYTES, 0, BLOCK_BYTES,
                    BLOCK_BYTES)
    with daemon.client() as c:
        _refused(c, KVLayout(NUM_BLOCKS, (region,)), "permission_denied",
                 "by shared-memory name are refused")
        # The generations by name too, with memory sent the right way.
        by_name = dataclasses.replace(arena.layout, generations="kvgen_1_000000000000")
        _refused(c, by_name, "permission_denied", "block generations names shared memory")
        assert c.health()["status"] == "ok"


def test_memory_that_could_shrink_or_may_not_be_written_is_refused(
        daemon: RunningDaemon, tmp_path) -> None:
    size = NUM_BLOCKS * BLOCK_BYTES
    region = Region(0, size, 0, BLOCK_BYTES, BLOCK_BYTES)
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, size)
    plain_file = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(plain_file, size)
    sealed = AnonymousMemory(size, "sealed")
    read_only = os.open(f"/proc/self/fd/{sealed.fd}", os.O_RDONLY)
    try:
        with daemon.client() as c:
            _refused(c, KVLayout(NUM_BLOCKS, (region,), fds=(unsealed,)), "bad_request",
                     "sealed against shrinking")
            _refused(c, KVLayout(NUM_BLOCKS, (region,), fds=(plain_file,)), "bad_request",
                     "not sealable shared memory")
            _refused(c, KVLayout(NUM_BLOCKS, (region,), fds=(read_only,)), "bad_request",
                     "cannot map its memory for writing")
            reg = c.register(KVLayout(NUM_BLOCKS, (region,), fds=(sealed.fd,)), "sealed")
            assert c.unregister(reg)
    finally:
        for fd in (unsealed, plain_file, read_only):
            os.close(fd)
        sealed.close()


def test_the_engines_memory_cannot_shrink_under_the_daemon() -> None:
    memory = AnonymousMemory(2 * mmap.PAGESIZE, "sealed")
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(memory.fd, mmap.PAGESIZE)
        with pytest.raises(PermissionError):
            os.ftruncate(memory.fd, 4 * mmap.PAGESIZE)
    finally:
        memory.close()


def test_memory_is_registered_once_while_its_registration_lives(
        daemon: RunningDaemon, arenas: list[ShmArena]) -> None:
    arena = ShmArena(NUM_BLOCKS, BLOCK_BYTES, 2, generations=True)
    arenas.append(arena)
    chain = make_chain("registered-once", 2, seed=2)
    duplicate = os.dup(arena.memory.fd)
    reopened = os.open(f"/proc/self/fd/{arena.memory.fd}", os.O_RDWR)  # as another process could
    gens_reopened = os.open(f"/proc/self/fd/{arena.generations.fd}", os.O_RDWR)
    try:
        with daemon.client() as owner, daemon.client() as other:
            reg = owner.register(arena.layout, "owner")
            for client in (owner, other):
                for fd in (duplicate, reopened):
                    second = dataclasses.replace(arena.layout, fds=(fd,), generations=None)
                    _refused(client, second, "permission_denied", "registered already")
            # Its block generations alone are held too (with memory of the second's own).
            own = ShmArena(NUM_BLOCKS, BLOCK_BYTES, 3)
            arenas.append(own)
            _refused(other, own.layout.with_generations(gens_reopened), "permission_denied",
                     "block generations: its memory is registered already")
            # The refusals left the owner's registration whole.
            assert owner.save(reg, chain.namespace, [0, 1], chain.hashes,
                              chain.idents).num_saved == 2
            assert other.register(own.layout, "own") > 0  # its own memory: fine
            assert owner.unregister(reg)
            again = other.register(dataclasses.replace(arena.layout, fds=(reopened,),
                                                       generations=None), "after")
            assert again > 0
        # Once its connection is gone, so is its hold.
        with daemon.client() as third:
            assert wait_until(lambda: _registers(third, arena.layout), timeout_s=5)
    finally:
        for fd in (duplicate, reopened, gens_reopened):
            os.close(fd)


def _registers(client, layout: KVLayout) -> bool:
    try:
        return client.unregister(client.register(layout, "third"))
    except ClientError as exc:
        assert exc.code == "permission_denied", exc
        return False


def test_a_connection_keeps_a_bounded_number_of_mappings(arenas: list[ShmArena]) -> None:
    registry = Registry(max_mappings_per_owner=2)
    made = [ShmArena(2, BLOCK_BYTES, i) for i in range(3)]
    arenas += made
    regs = [registry.register(a.layout.to_wire(), "e", "conn-1", a.layout.fds)
            for a in made[:2]]
    with pytest.raises(RegistryError) as info:
        registry.register(made[2].layout.to_wire(), "e", "conn-1", made[2].layout.fds)
    assert info.value.code == "resource_exhausted"
    other = registry.register(made[2].layout.to_wire(), "e2", "conn-2", made[2].layout.fds)
    assert registry.unregister(regs[0].registration_id, "conn-1")
    assert registry.unregister(other.registration_id, "conn-2")
    registry.register(made[2].layout.to_wire(), "e", "conn-1", made[2].layout.fds)
    registry.close_all()


def test_a_live_engine_id_is_not_taken_by_another_connection(daemon: RunningDaemon,
                                                              arenas: list[ShmArena]) -> None:
    """A router maps engines by the engine_id their registrations carry: a second client of
    the same uid registering under a live engine's id would take its routes. Refused while
    the first lives; the same connection may register more under it; free once it is gone."""
    first, second, third = (ShmArena(NUM_BLOCKS, BLOCK_BYTES, i, generations=True)
                            for i in range(3))
    arenas.extend([first, second, third])
    with daemon.client() as owner, daemon.client() as other:
        owner.register(first.layout, "engine-a")
        with pytest.raises(ClientError) as info:
            other.register(second.layout, "engine-a")
        assert info.value.code == "permission_denied" and "engine-a" in info.value.message
        owner.register(third.layout, "engine-a")  # its own connection: allowed
        other.register(second.layout, "engine-b")
    with daemon.client() as later:
        arena = ShmArena(NUM_BLOCKS, BLOCK_BYTES, 4, generations=True)
        arenas.append(arena)
        assert wait_until(lambda: _registers_as(later, arena.layout, "engine-a"),
                          timeout_s=5.0)


def _registers_as(client, layout: KVLayout, engine_id: str) -> bool:
    try:
        client.register(layout, engine_id)
    except ClientError:
        return False
    return True


def test_connections_holding_registrations_are_bounded(arenas: list[ShmArena]) -> None:
    """A connection that holds a registration is never reclaimed: a same-uid client that
    registered on every connection locked new clients out until the idle timeout. The daemon
    keeps half its connection cap for connections without registrations."""
    from kvstore.daemon.limits import ConnectionLimits

    assert ConnectionLimits(max_connections=10).max_registered_connections == 5
    registry = Registry(max_owners=2)
    made = [ShmArena(2, BLOCK_BYTES, i) for i in range(5)]
    arenas += made

    def register(arena: ShmArena, engine_id: str, owner: str):
        return registry.register(arena.layout.to_wire(), engine_id, owner, arena.layout.fds)

    first = register(made[0], "e1", "conn-1")
    register(made[1], "e2", "conn-2")
    with pytest.raises(RegistryError) as info:
        register(made[2], "e3", "conn-3")
    assert info.value.code == "resource_exhausted" and "new clients" in str(info.value)
    register(made[3], "e1", "conn-1")  # a connection that holds some may hold more
    assert registry.drop_owner("conn-2") == 1  # its connection closed: room again
    register(made[2], "e3", "conn-3")
    # A connection that closed counts no more while its registrations are being dropped: the
    # engine reconnecting at the cap is not refused in that window.
    registry.owner_leaving("conn-3")
    register(made[1], "e2", "conn-4")
    with pytest.raises(RegistryError) as info:
        register(made[4], "e5", "conn-5")  # conn-1 and conn-4 hold registrations: the cap
    assert info.value.code == "resource_exhausted"
    assert registry.unregister(first.registration_id, "conn-1")
    registry.close_all()


def test_memory_is_held_until_the_last_copy_of_a_closed_registration_is_done(
        arenas: list[ShmArena]) -> None:
    """A reconnecting engine registers the same memory again; that is accepted only once no
    copy of its old registration still reads or writes it, so an engine that sees the new
    registration accepted may reuse what it lent a request that got no reply."""
    registry = Registry()
    arena = ShmArena(NUM_BLOCKS, BLOCK_BYTES, 5, generations=True)
    arenas.append(arena)

    def register(owner: str):
        return registry.register(arena.layout.to_wire(), "engine", owner, arena.layout.fds)

    old = register("conn-1")
    with old.open_for_copy():  # a copy still runs when the connection goes
        assert registry.drop_owner("conn-1") == 1
        assert old.closed
        with pytest.raises(RegistryError) as info:
            register("conn-2")
        assert info.value.code == "permission_denied" and "registered already" in str(info.value)
    again = register("conn-2")  # the copy is done: the memory is free
    assert again.registration_id != old.registration_id
    registry.close_all()


def test_an_engine_that_reconnects_gets_its_memory_back_at_once(
        daemon: RunningDaemon, arenas: list[ShmArena]) -> None:
    """The registration of a connection that just closed is still being dropped (its last
    reply came from a worker, before the loop was done with the request) when the engine
    registers the same memory on a new connection: that waits for the drop, never refused."""
    arena = ShmArena(NUM_BLOCKS, BLOCK_BYTES, 4)
    arenas.append(arena)
    for i in range(20):
        chain = make_chain(f"reconnect-{i}", 2, seed=i)
        with daemon.client() as first:
            reg = first.register(arena.layout, "reconnecting")
            assert first.save(reg, chain.namespace, [0, 1], chain.hashes,
                              chain.idents).num_saved == 2
        with daemon.client() as again:
            assert again.register(arena.layout, "reconnecting") > 0


def test_leaving_owners_are_waited_for_within_a_bound() -> None:
    import threading
    import time

    from kvstore.engines.leaving_owners import LeavingOwners

    leaving = LeavingOwners()
    assert not leaving.wait(1.0)  # nobody leaving: no wait, no retry
    leaving.mark("conn-1")
    started = time.monotonic()
    assert not leaving.wait(0.05)  # never dropped: given up at the bound
    assert 0.04 <= time.monotonic() - started < 1.0
    threading.Timer(0.05, leaving.gone, ("conn-1",)).start()
    assert leaving.wait(5.0)
