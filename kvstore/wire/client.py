"""The Python client of the daemon: one connection, many requests in flight, thread-safe.

Every request returns a ``Pending`` handle (``poll()``, ``wait(timeout)``); the blocking methods
are ``request(...).wait()``. A reader thread dispatches replies by request id, so an engine's step
loop can send a load, keep stepping, and poll it. Dropping a handle detaches the observer, not the
work: the daemon still finishes (or times out) the request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvstore.layout import KVLayout
from kvstore.wire import protocol as proto
from kvstore.wire.connection import Connection
from kvstore.wire.replies import (  # noqa: F401 (the client's reply and error types, re-exported)
    ClientError,
    DaemonUnavailable,
    EngineBlocks,
    LocateReply,
    LookupReply,
    Pending,
    ProtocolMismatch,
    RequestTimeout,
    SaveReply,
    error_of,
    locate_reply,
    lookup_reply,
)


class Client(Connection):
    """A connection to ``kvstore serve`` with its verbs (``Connection`` sends and dispatches);
    usable from many threads at once."""

    # ----------------------------------------------------------------------- the bytes API

    def put(self, key: bytes, value: Any, namespace: str = "default") -> str:
        """Store ``value`` (bytes, memoryview, any buffer such as a numpy array) under ``key``.

        A put replaces: returns "stored" for a new key, "replaced" when an older value under
        ``key`` was replaced (in every tier of the daemon). ClientError if it could not be.
        """
        reply = self.call("put", {"namespace": namespace, "key": bytes(key),
                                  "value": _as_bytes(value)})
        return "replaced" if reply.get("replaced") else "stored"

    def get(self, key: bytes, namespace: str = "default") -> bytes | None:
        """Exactly the bytes put under ``key``, or None."""
        return self.call("get", {"namespace": namespace, "key": bytes(key)})["value"]

    def stats(self) -> dict:
        return self.call("stats")

    def engines_async(self, timeout_s: float | None = None) -> Pending:
        """``engines`` without waiting: a ``Pending`` of the list of registered engines."""
        return self.request("engines", timeout_s=timeout_s, convert=lambda r: list(r["engines"]))

    def engines(self) -> list[dict]:
        """The registered engines (``registration_id``, ``engine_id``, ``device``, and the
        ``model_identity`` and ``num_shards`` each declared in its layout's meta, or None)."""
        return self.engines_async().wait()

    def health_async(self, timeout_s: float | None = None) -> Pending:
        return self.request("health", timeout_s=timeout_s)

    def health(self) -> dict:
        return self.health_async().wait()

    # ----------------------------------------------------------------------- the block API

    def lookup_async(self, namespace: bytes, hashes: Sequence[bytes], idents: Sequence[bytes],
                     lease_ttl_s: float | None = None) -> Pending:
        """The longest verified prefix, without waiting (a ``Pending`` of the LookupReply)."""
        args = _chain_args(namespace, hashes, idents)
        if lease_ttl_s is not None:
            args["lease_ttl_s"] = lease_ttl_s
        return self.request("lookup", args, convert=lookup_reply)

    def lookup_nowait(self, namespace: bytes, hashes: Sequence[bytes],
                      idents: Sequence[bytes], lease_ttl_s: float | None,
                      finish: Callable[[Callable[[], None]], Any]) -> Pending | None:
        """``lookup_async`` that never blocks the caller (``request_nowait``): None when it
        was not sent (send it with ``lookup_async`` from a thread that may block)."""
        args = _chain_args(namespace, hashes, idents)
        if lease_ttl_s is not None:
            args["lease_ttl_s"] = lease_ttl_s
        return self.request_nowait("lookup", args, None, lookup_reply, finish)

    def lookup(self, namespace: bytes, hashes: Sequence[bytes], idents: Sequence[bytes],
               lease_ttl_s: float | None = None) -> LookupReply:
        """Longest verified prefix; a hit comes with a lease (``lease_ttl_s`` 0: no lease)."""
        return self.lookup_async(namespace, hashes, idents, lease_ttl_s).wait()

    def lookup_load_async(self, registration_id: int, namespace: bytes,
                          hashes: Sequence[bytes], idents: Sequence[bytes],
                          block_ids: Sequence[int], lease_ttl_s: float | None = None,
                          min_blocks: int = 1, timeout_s: float | None = None) -> Pending:
        """A lookup whose hit the daemon loads at once into ``block_ids`` (one per hash) when
        it is all in HBM or DRAM and at least ``min_blocks`` long: a ``Pending`` of the
        LookupReply, with ``num_loaded`` set if it loaded (else the hit's lease, as a lookup's).
        ``timeout_s`` is the copy's deadline, as for ``load``."""
        args = _chain_args(namespace, hashes, idents)
        args.update(registration_id=registration_id, block_ids=[int(b) for b in block_ids],
                    min_blocks=int(min_blocks))
        if lease_ttl_s is not None:
            args["lease_ttl_s"] = lease_ttl_s
        return self.request("lookup_load", args, timeout_s, convert=lookup_reply)

    def release_async(self, lease_id: int) -> Pending:
        """Give a lease back; the result says whether it was still held."""
        return self.request("release", {"lease_id": lease_id},
                            convert=lambda r: bool(r["released"]))

    def locate_async(self, namespace: bytes, hashes: Sequence[bytes], idents: Sequence[bytes],
                     timeout_s: float | None = None) -> Pending:
        """``locate`` without waiting: a ``Pending`` of the LocateReply."""
        return self.request("locate", _chain_args(namespace, hashes, idents), timeout_s,
                            convert=locate_reply)

    def locate_nowait(self, namespace: bytes, hashes: Sequence[bytes],
                      idents: Sequence[bytes], timeout_s: float | None,
                      finish: Callable[[Callable[[], None]], Any]) -> Pending | None:
        """``locate_async`` that never blocks the caller (``request_nowait``): None when it
        was not sent."""
        return self.request_nowait("locate", _chain_args(namespace, hashes, idents), timeout_s,
                                   locate_reply, finish)

    def locate(self, namespace: bytes, hashes: Sequence[bytes], idents: Sequence[bytes],
               timeout_s: float | None = None) -> LocateReply:
        """Where the chain's leading blocks are (each registered engine's arena, the store's
        tiers), with no lease taken and nothing touched: what a router asks."""
        return self.locate_async(namespace, hashes, idents, timeout_s).wait()

    def release(self, lease_id: int) -> bool:
        return self.release_async(lease_id).wait()

    def remove(self, namespace: bytes, hashes: Sequence[bytes]) -> int:
        """Drop blocks from every tier (unless leased); returns how many were dropped."""
        return self.call("remove", {"namespace": namespace, "hashes": list(hashes)})["num_removed"]

    def register_async(self, layout: KVLayout | dict, engine_id: str,
                       timeout_s: float | None = None,
                       fds: Sequence[int] | None = None) -> Pending:
        """Describe this engine's KV memory to the daemon; the result is the registration
        id. The memory's file descriptors go with the frame: ``fds``, else ``layout.fds``
        (the daemon maps its own copies; the caller's stay open)."""
        wire = layout.to_wire() if isinstance(layout, KVLayout) else layout
        if fds is None and isinstance(layout, KVLayout):
            fds = layout.fds
        return self.request("register", {"layout": wire, "engine_id": engine_id}, timeout_s,
                            lambda r: int(r["registration_id"]), fds or ())

    def register(self, layout: KVLayout | dict, engine_id: str,
                 fds: Sequence[int] | None = None) -> int:
        return self.register_async(layout, engine_id, fds=fds).wait()

    def unregister_async(self, registration_id: int, timeout_s: float | None = None) -> Pending:
        return self.request("unregister", {"registration_id": registration_id}, timeout_s,
                            lambda r: bool(r["unregistered"]))

    def unregister(self, registration_id: int) -> bool:
        return self.unregister_async(registration_id).wait()

    def save_async(self, registration_id: int, namespace: bytes, block_ids: Sequence[int],
                   hashes: Sequence[bytes], idents: Sequence[bytes],
                   timeout_s: float | None = None) -> Pending:
        args = {"registration_id": registration_id, "namespace": namespace,
                "block_ids": [int(b) for b in block_ids], "hashes": list(hashes),
                "idents": list(idents)}
        return self.request("save", args, timeout_s, lambda r: SaveReply(list(r["outcomes"])))

    def save(self, registration_id: int, namespace: bytes, block_ids: Sequence[int],
             hashes: Sequence[bytes], idents: Sequence[bytes],
             timeout_s: float | None = None) -> SaveReply:
        """Copy engine blocks into the store; the reply comes after every copy is done."""
        return self.save_async(registration_id, namespace, block_ids, hashes, idents,
                               timeout_s).wait()

    def load_async(self, registration_id: int, lease_id: int, block_ids: Sequence[int],
                   timeout_s: float | None = None) -> Pending:
        args = {"registration_id": registration_id, "lease_id": lease_id,
                "block_ids": [int(b) for b in block_ids]}
        return self.request("load", args, timeout_s, lambda r: int(r["num_loaded"]))

    def load(self, registration_id: int, lease_id: int, block_ids: Sequence[int],
             timeout_s: float | None = None) -> int:
        """Copy leased blocks into engine blocks; returns how many arrived (a prefix)."""
        return self.load_async(registration_id, lease_id, block_ids, timeout_s).wait()

    def resident_async(self, registration_id: int, namespace: bytes, block_ids: Sequence[int],
                       hashes: Sequence[bytes], idents: Sequence[bytes],
                       generations: Sequence[int]) -> Pending:
        args = {"registration_id": registration_id, "namespace": namespace,
                "block_ids": [int(b) for b in block_ids], "hashes": list(hashes),
                "idents": list(idents), "generations": [int(g) for g in generations]}
        return self.request("resident", args, convert=lambda r: int(r["num_indexed"]))

    def resident(self, registration_id: int, namespace: bytes, block_ids: Sequence[int],
                 hashes: Sequence[bytes], idents: Sequence[bytes],
                 generations: Sequence[int]) -> int:
        """Publish blocks held in this engine's KV memory (the HBM tier), as of each block's
        generation; returns how many the daemon indexed (the rest were already reallocated)."""
        return self.resident_async(registration_id, namespace, block_ids, hashes, idents,
                                   generations).wait()

    def evicted_async(self, namespace: bytes, hashes: Sequence[bytes],
                      registration_id: int | None = None) -> Pending:
        """Tell the daemon the engine dropped these blocks from its HBM; the result is how
        many it acknowledged."""
        args: dict[str, Any] = {"namespace": namespace, "hashes": list(hashes)}
        if registration_id is not None:
            args["registration_id"] = registration_id
        return self.request("evicted", args, convert=lambda r: int(r["num_acknowledged"]))

    def evicted(self, namespace: bytes, hashes: Sequence[bytes],
                registration_id: int | None = None) -> int:
        return self.evicted_async(namespace, hashes, registration_id).wait()


def _chain_args(namespace: bytes, hashes: Sequence[bytes],
                idents: Sequence[bytes]) -> dict[str, Any]:
    """A chain's arguments (lookup, locate): idents of one length (the engine's case) go
    packed, two bins instead of 2N items."""
    hashes, idents = list(hashes), list(idents)
    packed = proto.pack_lookup(hashes, idents)
    args: dict[str, Any] = {"namespace": namespace}
    if packed is None:
        args["hashes"], args["idents"] = hashes, idents
    else:
        args.update(packed)
    return args


def _as_bytes(value: Any) -> bytes | memoryview:
    # Any C-contiguous buffer goes out without a copy; a strided one is copied in C order.
    if isinstance(value, bytes):
        return value
    view = memoryview(value)
    if not view.c_contiguous:
        return view.tobytes()
    try:
        return view.cast("B")
    except TypeError:
        return view.tobytes()
