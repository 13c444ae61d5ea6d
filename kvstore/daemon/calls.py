"""What a verb call carries and may answer: its context, its error, a deferred remainder."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.engines.registration import RegistryError
from kvstore.store.block_store import StoreError


class ServiceError(Exception):
    """A request that failed in a way the client should see; ``code`` is a protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(eq=False)  # hashed by identity: the daemon keeps a set of running calls
class CallContext:
    """Who is calling and until when; ``cancel()`` asks a running copy to stop at the next block."""

    owner: str
    deadline: float  # time.monotonic() seconds
    on_loop: bool = False  # called on the event loop: waiting on peers must be deferred
    # The file descriptors sent with the request's frame (``wire/fds.py``), open until the call
    # ends: a verb that keeps their memory maps it.
    fds: tuple[int, ...] = ()
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set() or time.monotonic() >= self.deadline

    def check(self) -> None:
        if self.cancelled:
            raise ServiceError("deadline_exceeded", "the request's deadline passed")


# A verb's handler: the validated args and the call's context in, the reply's result out.
Handler = Callable[[dict, CallContext], Any]


@dataclass(frozen=True)
class Deferred:
    """What an inline call returns when the rest must not run on the event loop (it waits on
    peers): the daemon calls ``run()`` on a worker thread, or ``abandon()`` if it never will."""

    run: Callable[[], Any]
    abandon: Callable[[], None]


def with_mapped_errors(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, with registry and store errors turned into the ServiceError clients see."""
    try:
        return fn(*args)
    except RegistryError as exc:
        raise ServiceError(exc.code, str(exc)) from None
    except StoreError as exc:
        raise ServiceError("store_error", str(exc) or type(exc).__name__) from None
