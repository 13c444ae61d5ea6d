"""Listeners: how a kvstore part tells others of an event, the one way every hook is built.

A hook belongs to its owner's contract: the owner declares it (listeners given to its
constructor, and an ``add_*_listener`` method, with ``remove_*`` where one stops listening
before the owner closes), never an attribute that a user assigns from outside, so a second
user adds itself instead of silently replacing the first. Listeners are told in the order
they were added, on the thread that saw the event, outside the owner's locks; a listener's
failure is logged and reaches neither the owner's caller nor the other listeners.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

Listener = TypeVar("Listener", bound=Callable[..., None])


class Listeners(Generic[Listener]):
    """An ordered set of listeners of one event (``what`` names it in the log); thread-safe."""

    def __init__(self, what: str, listeners: Iterable[Listener] = ()) -> None:
        self._what = what
        self._listeners: tuple[Listener, ...] = tuple(listeners)
        self._lock = threading.Lock()

    def add(self, listener: Listener) -> None:
        with self._lock:
            self._listeners += (listener,)

    def remove(self, listener: Listener) -> None:
        """Stop telling ``listener`` (harmless if it was not listening)."""
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x != listener)

    def __bool__(self) -> bool:
        """Whether anyone listens (an owner may skip noting events nobody hears)."""
        return bool(self._listeners)

    def tell(self, *args: object) -> None:
        """Call every listener with ``args``; never raises for a listener's failure."""
        for listener in self._listeners:  # a snapshot: one added meanwhile hears the next event
            try:
                listener(*args)
            except Exception:
                log.exception("a listener of %s failed", self._what)
