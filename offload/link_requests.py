"""What an engine asks of the store, as values: one frozen class per verb.

The step thread builds a request and hands it, with its ``Transfer`` handle, to the link's
thread (``offload.link_thread``), which puts it on the wire with ``send``: the request stays
readable on both sides of the thread hop, and each verb goes through ``kvstore.Client``'s own
method for it (nothing sends a verb by name).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore import Client, Pending


class LinkRequest(ABC):
    """A request the link's thread sends on the connection it holds."""

    copies = False  # True: the daemon moves bytes in or out of the engine's blocks
    # True: a request waits on its reply and it names no memory, so it may overtake what is
    # queued (``offload/link_queue.py``); only such requests have a ``send_nowait``.
    urgent = False

    @abstractmethod
    def send(self, client: Client, registration_id: int | None,
             timeout_s: float | None = None) -> Pending:
        """Put the request on the wire (may block while the socket is full: link thread).
        ``timeout_s``: what is left of the caller's deadline; a copy's daemon must not start
        after the engine gave up on it (it may have reused the blocks)."""

    def send_nowait(self, client: Client,
                    finish: Callable[[Callable[[], None]], Any]) -> Pending | None:
        """Put the request on the wire from the caller's thread without ever blocking (the
        rest of a frame the socket took in part goes to ``finish``); None when not sent (the
        link's thread sends it). Only requests that name no registered memory may."""
        return None


def _left(timeout_s: float | None, deadline_s: float | None) -> float | None:
    """The daemon's bound for a copy: what is left of the engine's wait when it is sent."""
    if timeout_s is None:
        return deadline_s
    return timeout_s if deadline_s is None else min(timeout_s, deadline_s)


def _registered(registration_id: int | None, verb: str) -> int:
    if registration_id is None:
        raise ValueError(f"{verb} needs registered KV memory; this link registered none")
    return registration_id


@dataclass(frozen=True)
class LookupRequest(LinkRequest):
    """The longest verified prefix of a chain; a hit comes with a lease."""

    urgent = True

    namespace: bytes
    hashes: list[bytes]
    idents: list[bytes]
    lease_ttl_s: float

    def send(self, client: Client, registration_id: int | None,
             timeout_s: float | None = None) -> Pending:
        return client.lookup_async(self.namespace, self.hashes, self.idents, self.lease_ttl_s)

    def send_nowait(self, client: Client,
                    finish: Callable[[Callable[[], None]], Any]) -> Pending | None:
        return client.lookup_nowait(self.namespace, self.hashes, self.idents, self.lease_ttl_s,
                                    finish)


@dataclass(frozen=True)
class LookupLoadRequest(LinkRequest):
    """A lookup whose hit the daemon loads at once into ``block_ids`` (one per hash) if it is
    all in HBM or DRAM and at least ``min_blocks`` long; else the hit comes back leased."""

    copies = True

    namespace: bytes
    hashes: list[bytes]
    idents: list[bytes]
    block_ids: list[int]
    lease_ttl_s: float
    min_blocks: int
    deadline_s: float | None

    def send(self, client: Client, registration_id: int | None,
             timeout_s: float | None = None) -> Pending:
        return client.lookup_load_async(
            _registered(registration_id, "lookup_load"), self.namespace, self.hashes,
            self.idents, self.block_ids, self.lease_ttl_s, self.min_blocks,
            _left(timeout_s, self.deadline_s))


@dataclass(frozen=True)
class LoadRequest(LinkRequest):
    """Copy a lease's blocks into the engine's ``block_ids`` (daemon-side ids)."""

    copies = True

    lease_id: int
    block_ids: list[int]
    deadline_s: float | None

    def send(self, client: Client, registration_id: int | None,
             timeout_s: float | None = None) -> Pending:
        return client.load_async(_registered(registration_id, "load"), self.lease_id,
                                 self.block_ids, _left(timeout_s, self.deadline_s))


@dataclass(frozen=True)
class SaveRequest(LinkRequest):
    """Copy the engine's ``block_ids`` into the store under ``hashes`` / ``idents``."""

    copies = True

    namespace: bytes
    block_ids: list[int]
    hashes: list[bytes]
    idents: list[bytes]
    deadline_s: float | None

    def send(self, client: Client, registration_id: int | None,
             timeout_s: float | None = None) -> Pending:
        return client.save_async(_registered(registration_id, "save"), self.namespace,
                                 self.block_ids, self.hashes, self.idents,
                                 _left(timeout_s, self.deadline_s))


@dataclass(frozen=True)
class ReleaseRequest(LinkRequest):
    """Give a lease back unused."""

    lease_id: int

    def send(self, client: Client, registration_id: int | None,
             timeout_s: float | None = None) -> Pending:
        return client.release_async(self.lease_id)


@dataclass(frozen=True)
class ResidentRequest(LinkRequest):
    """Blocks held in the engine's arena now, as of their generations (the HBM tier)."""

    namespace: bytes
    block_ids: list[int]
    hashes: list[bytes]
    idents: list[bytes]
    generations: list[int]

    def send(self, client: Client, registration_id: int | None,
             timeout_s: float | None = None) -> Pending:
        return client.resident_async(_registered(registration_id, "resident"), self.namespace,
                                     self.block_ids, self.hashes, self.idents, self.generations)


@dataclass(frozen=True)
class EvictedRequest(LinkRequest):
    """Blocks the engine dropped from its arena."""

    namespace: bytes
    hashes: list[bytes]

    def send(self, client: Client, registration_id: int | None,
             timeout_s: float | None = None) -> Pending:
        return client.evicted_async(self.namespace, self.hashes, registration_id)
