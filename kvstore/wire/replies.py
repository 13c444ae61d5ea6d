"""What the client hands back: ``Pending`` handles, reply types, and the errors it raises."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.wire import protocol as proto

log = logging.getLogger("kvstore.client")

# The client waits this much longer than the deadline it sent, so the daemon's own
# deadline_exceeded reply normally arrives first.
_GRACE_S = 1.0


class ClientError(Exception):
    """The daemon answered with an error; ``code`` is a protocol error code (``bad_request``...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ProtocolMismatch(ClientError):
    """The daemon speaks another major version of the protocol; the message names both."""

    def __init__(self, message: str) -> None:
        super().__init__("protocol_mismatch", message)


class RequestTimeout(ClientError, TimeoutError):
    """No reply within the wait's timeout; the request may still complete in the daemon."""

    def __init__(self, message: str) -> None:
        super().__init__("timeout", message)


class DaemonUnavailable(ConnectionError):
    """The daemon is not running, refused us, or the connection broke."""


def error_of(reply: dict) -> ClientError:
    """The ClientError an error reply carries."""
    err = reply.get("error") or {}
    return ClientError(str(err.get("code")), str(err.get("message")))


@dataclass(frozen=True)
class LookupReply:
    """``num_loaded``: only a ``lookup_load`` sets it, when it loaded the hit (then there is no
    lease: the load used it up); None when nothing was loaded."""

    num_hit: int
    tiers: list[str]
    lease_id: int | None
    num_loaded: int | None = None


@dataclass(frozen=True)
class SaveReply:
    outcomes: list[str]  # per block: "saved", "duplicate" or "failed"

    @property
    def num_saved(self) -> int:
        return self.outcomes.count("saved")


def lookup_reply(r: dict) -> LookupReply:
    """Either reply form: per-block ``tiers``, or ``tier_runs`` for a packed request."""
    tiers = proto.expand_tier_runs(r["tier_runs"]) if "tier_runs" in r else list(r["tiers"])
    num_loaded = r.get("num_loaded")
    return LookupReply(int(r["num_hit"]), tiers, r["lease_id"],
                       None if num_loaded is None else int(num_loaded))


@dataclass(frozen=True)
class EngineBlocks:
    """One registered engine in a locate reply: the chain's leading blocks in its arena."""

    registration_id: int
    engine_id: str
    device: str
    num_hbm: int


@dataclass(frozen=True)
class LocateReply:
    """Where a chain's leading blocks are: each registered engine's arena, and the store's
    verified prefix (``store_tiers``: "dram" or "ssd" per block)."""

    num_blocks: int
    engines: list[EngineBlocks]
    store_tiers: list[str]

    @property
    def num_stored(self) -> int:
        """Leading blocks the store (DRAM or SSD) holds."""
        return len(self.store_tiers)

    @property
    def num_dram(self) -> int:
        """Leading blocks all in DRAM."""
        tiers = self.store_tiers
        return tiers.index("ssd") if "ssd" in tiers else len(tiers)


def locate_reply(r: dict) -> LocateReply:
    engines = [EngineBlocks(int(e["registration_id"]), str(e["engine_id"]), str(e["device"]),
                            int(e["num_hbm"])) for e in r["engines"]]
    return LocateReply(int(r["num_blocks"]), engines, proto.expand_tier_runs(r["tier_runs"]))


_NO_RESULT = object()


class Pending:
    """A request in flight: ``poll()`` never blocks, ``wait()`` returns the result or raises."""

    def __init__(self, forget: Callable[[int], None], request_id: int, verb: str,
                 timeout_s: float, convert: Callable[[Any], Any] | None) -> None:
        """``forget(request_id)``: the client stops waiting for the reply (on a timeout)."""
        self.request_id = request_id
        self.verb = verb
        self.timeout_s = timeout_s
        self._forget = forget
        self._convert = convert
        # A lock held until the reply lands: waking a waiter on it is cheaper than an Event.
        self._done = False
        self._gate = threading.Lock()
        self._gate.acquire()
        self._result: Any = _NO_RESULT
        self._error: BaseException | None = None
        self.landed_at: float | None = None  # time.monotonic() when the reply came in
        # Called once each when the reply lands; list.pop is atomic, so whoever pops one
        # (finish, or add_done_callback after it) calls it, exactly once.
        self._callbacks: list[Callable[[Pending], None]] = []

    def finish(self, result: Any = _NO_RESULT, error: BaseException | None = None) -> None:
        """Land the reply (or ``error``); called only by whoever popped this request from the
        client's table, so exactly once."""
        if self._done:
            return
        if error is None and self._convert is not None:
            try:
                result = self._convert(result)
            except Exception as exc:  # a reply we cannot read is the daemon's bug; surface it
                error = ClientError("bad_reply", f"{self.verb}: unreadable reply: {exc}")
        self._result, self._error = result, error
        self.landed_at = time.monotonic()
        self._done = True
        self._gate.release()
        if self._callbacks:  # read after _done is set: an add that missed this sees _done
            self._run_callbacks()

    def add_done_callback(self, fn: Callable[[Pending], None]) -> None:
        """Call ``fn(self)`` once the reply (or a failure) is in: on the client's reader thread
        as it lands, or here and now if it has. ``fn`` must be quick (it holds up every other
        reply of the connection) and must not block; what it raises is logged."""
        self._callbacks.append(fn)
        if self._done:
            self._run_callbacks()

    def _run_callbacks(self) -> None:
        while True:
            try:
                fn = self._callbacks.pop()
            except IndexError:
                return
            try:
                fn(self)
            except Exception:  # the reader thread must go on dispatching the other replies
                log.exception("a done callback of %s (request %d) failed", self.verb,
                              self.request_id)

    def poll(self) -> bool:
        """True once the reply (or a failure) is in; ``wait()`` then returns without blocking."""
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        """The result; raises ClientError, RequestTimeout or DaemonUnavailable.

        ``timeout`` None waits the request's own deadline plus a grace second; after that the
        handle is given up (the daemon has answered deadline_exceeded or is stuck).
        """
        limit = self.timeout_s + _GRACE_S if timeout is None else timeout
        if not self._done and not self._wait_gate(limit):
            if timeout is None:
                self._forget(self.request_id)
            raise RequestTimeout(f"{self.verb} (request {self.request_id}) got no reply in "
                                 f"{limit:.3g} s")
        if self._error is not None:
            raise self._error
        return self._result

    result = wait

    def _wait_gate(self, limit: float) -> bool:
        if not self._gate.acquire(timeout=max(limit, 0.0)):
            return self._done
        self._gate.release()  # leave it open for any other waiter
        return True
