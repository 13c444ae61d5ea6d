"""Hooks are listeners their owner declares: a second user adds itself beside the first, a
failing listener fails neither the owner's caller nor the others, and one that stops listening
hears nothing more. Checked on ``Listeners`` and on the registry's closed registrations (once a
single slot that a second user silently overwrote)."""

from __future__ import annotations

import logging

from support.arena import ShmArena

from kvstore.engines.registry import Registry
from kvstore.listeners import Listeners


def test_every_listener_is_told_in_order_and_a_failure_stops_none(caplog) -> None:
    heard: list[tuple[str, int]] = []

    def broken(value: int) -> None:
        raise RuntimeError("listener bug")

    listeners = Listeners("test events", [lambda v: heard.append(("first", v))])
    assert listeners
    listeners.add(broken)
    listeners.add(lambda v: heard.append(("last", v)))
    with caplog.at_level(logging.ERROR, logger="kvstore.listeners"):
        listeners.tell(7)
    assert heard == [("first", 7), ("last", 7)]
    assert "a listener of test events failed" in caplog.text


def test_a_removed_listener_hears_nothing_more() -> None:
    heard: list[int] = []
    listeners: Listeners = Listeners("test events")
    assert not listeners
    listeners.add(heard.append)
    listeners.tell(1)
    listeners.remove(heard.append)  # an equal bound method: the same listener
    listeners.remove(heard.append)  # harmless when not listening
    listeners.tell(2)
    assert heard == [1] and not listeners


def test_every_close_listener_of_the_registry_hears_each_registration_leave() -> None:
    given: list[int] = []
    added: list[int] = []
    registry = Registry(close_listeners=[lambda reg: given.append(reg.registration_id)])
    registry.add_close_listener(lambda reg: added.append(reg.registration_id))
    arena = ShmArena(2, 4096, 1)
    try:
        reg = registry.register(arena.layout.to_wire(), "e", "conn-1", arena.layout.fds)
        assert registry.drop_owner("conn-1") == 1
        assert given == added == [reg.registration_id]
    finally:
        registry.close_all()
        arena.close()
