"""Fetches blocks from peers over UCX (the protocol is in ``transport.py``).

Endpoints are cached per peer (a few per address) and dropped on any error. Every fetch ends by
its deadline: a dead, slow or lying peer is a shorter answer plus a counted error, never a hang
and never wrong bytes. ``fetch_into`` receives the payloads straight into the local store's write
slots (no copy) and commits each only once its checksum matched; ``fetch`` returns the bytes in
reusable buffers. The transfers run on the shared UCX loop; both calls are synchronous, for the
daemon's worker threads.

A receive buffer is never reused, and a write slot never aborted, while UCX may still write into
it: after a failure each is let go only when its UCX request has finished (the endpoint is
aborted first, which cancels what is posted on it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.cluster.config import parse_host_port
from kvstore.cluster.peers.sinks import BufferPool, BufferSink, FetchResult, SlotSink
from kvstore.cluster.peers.transport import (
    PROTOCOL_VERSION,
    TAG_PAYLOAD,
    TAG_REQ,
    TAG_REQ_LEN,
    TAG_RESP,
    TAG_RESP_LEN,
    ProtocolError,
    abort_endpoint,
    checksum,
    parse_answer,
    recv_frame,
    send_frame,
)
from kvstore.cluster.ucx.runtime import UcxRuntime
from kvstore.cluster.ucx.transports import endpoint_transports
from kvstore.store.block_store import BlockStore

log = logging.getLogger(__name__)

_HANDOFF_GRACE_S = 0.5  # how much longer than the deadline the caller waits for the loop


@dataclass
class _Peer:
    idle: list = field(default_factory=list)
    slots: asyncio.Semaphore | None = None


class PeerClient:
    """Fetches blocks from peers with a per-peer pool of cached UCX endpoints."""

    def __init__(self, endpoints_per_peer: int = 4, max_block_bytes: int = 1 << 30,
                 buffer_pool_bytes: int = 1 << 30) -> None:
        self.endpoints_per_peer = endpoints_per_peer
        self.max_block_bytes = max_block_bytes
        self._buffers = BufferPool(buffer_pool_bytes)
        self._runtime: UcxRuntime | None = None
        self._peers: dict[str, _Peer] = {}
        self._lanes: dict[str, list[str] | None] = {}  # per address, of its newest endpoint
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()

    def start(self) -> None:
        if self._runtime is None:
            self._runtime = UcxRuntime.acquire()

    def close(self, timeout_s: float = 2.0) -> None:
        """Drop every cached endpoint. Idempotent."""
        if self._runtime is None:
            return
        with contextlib.suppress(Exception):
            self._runtime.call(self._drop_all(), timeout_s)
        self._runtime.release()
        self._runtime = None

    async def _drop_all(self) -> None:
        for peer in self._peers.values():
            for ep in peer.idle:
                abort_endpoint(ep)
            peer.idle.clear()
        self._peers.clear()

    def stats(self) -> dict:
        with self._lock:
            return dict(self._counters)

    def lanes(self) -> dict[str, list[str] | None]:
        """The UCX lanes (``endpoint_transports``) of the newest endpoint to each peer address
        this client connected to; None where UCX could not tell."""
        with self._lock:
            return dict(self._lanes)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    # -- the two calls -------------------------------------------------------------------------

    def fetch(self, addr: str, namespace: bytes, block_hashes: Sequence[bytes],
              idents: Sequence[bytes], deadline: float) -> FetchResult:
        """The longest verified prefix of the blocks that the peer at ``addr`` sends back by
        ``deadline`` (``time.monotonic()`` seconds), as bytes. Never raises for peer trouble.
        """
        sink = BufferSink(self._buffers)
        outcome = self._run(addr, namespace, block_hashes, idents, deadline, sink)
        if isinstance(outcome, str):
            return FetchResult([], outcome)
        entries, targets, error = outcome
        good: list[memoryview] = []
        for entry, view in zip(entries, targets):
            if checksum(view) != entry[3]:
                error = self._bad_block()
                break
            good.append(view.toreadonly())
        self._received(entries[:len(good)])
        return FetchResult(good, error, sink.buffer, self._buffers)

    def fetch_into(self, store: BlockStore, addr: str, namespace: bytes,
                   block_hashes: Sequence[bytes], idents: Sequence[bytes],
                   deadline: float) -> tuple[int, str | None]:
        """Like ``fetch``, but into ``store``: (how many of the blocks, from the first, the store
        now holds, the kind of error that cut the run short or None). Never raises for peer
        trouble; a block the store has no room for ends the run with "store_full".
        """
        sink = SlotSink(store, namespace)
        outcome = self._run(addr, namespace, block_hashes, idents, deadline, sink)
        if isinstance(outcome, str):
            return 0, outcome
        entries, targets, error = outcome
        num_ok = 0
        for entry, slot, target in zip(entries, sink.slots, targets):
            if slot is not None:
                if checksum(target) != entry[3]:
                    error = self._bad_block()
                    break
                slot.commit()
            num_ok += 1
        for slot in sink.slots[num_ok:]:
            if slot is not None:
                slot.abort()
        self._received(entries[:num_ok])
        if error is None and sink.refused and num_ok == len(targets):
            error = "store_full"
        return num_ok, error

    def _bad_block(self) -> str:
        self._count("errors_bad_block")
        return "bad_block"

    def _received(self, entries: list[list]) -> None:
        self._count("blocks_received", len(entries))
        self._count("bytes_received", sum(e[2] for e in entries))

    def _run(self, addr: str, namespace: bytes, block_hashes: Sequence[bytes],
             idents: Sequence[bytes], deadline: float, sink) -> tuple | str:
        """Run one fetch on the loop: (entries, targets, error) once the payloads are in, or
        the kind of failure (counted)."""
        if self._runtime is None:
            raise RuntimeError("PeerClient.start() first")
        if len(block_hashes) != len(idents):
            raise ValueError("block_hashes and idents differ in length")
        timeout_s = deadline - time.monotonic()
        if not block_hashes:
            return [], [], None
        if timeout_s <= 0:
            return self._failed("timeout")
        future = self._runtime.submit(asyncio.wait_for(
            self._fetch(addr, namespace, list(block_hashes), list(idents), deadline, sink),
            timeout_s))
        try:
            return future.result(timeout_s + _HANDOFF_GRACE_S)
        except (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError):
            finished = not future.cancel() and future.done() and future.exception() is None
            if finished and isinstance(sink, SlotSink):
                sink.abort_all()  # it finished as we gave up: nobody will commit its slots
            return self._failed("timeout")
        except ProtocolError as exc:
            log.info("fetch from %s: protocol error: %s", addr, exc)
            return self._failed("protocol")
        except _Unreachable as exc:
            log.info("fetch from %s: unreachable: %s", addr, exc)
            return self._failed("unreachable")
        except Exception as exc:  # a transport error: UCX raises its own types
            log.info("fetch from %s failed: %s: %s", addr, type(exc).__name__, exc)
            return self._failed("transport")

    def _failed(self, kind: str) -> str:
        self._count(f"errors_{kind}")
        return kind

    # -- on the loop ---------------------------------------------------------------------------

    async def _fetch(self, addr: str, ns: bytes, hashes: list[bytes], idents: list[bytes],
                     deadline: float, sink) -> tuple[list[list], list[memoryview], str | None]:
        peer = self._peers.setdefault(addr, _Peer())
        if peer.slots is None:
            peer.slots = asyncio.Semaphore(self.endpoints_per_peer)
        async with peer.slots:
            while True:
                ep = None
                while peer.idle and ep is None:
                    ep = peer.idle.pop()
                    if ep.closed:  # the peer hung up since (it stopped or restarted)
                        self._count("stale_endpoints")
                        abort_endpoint(ep)
                        ep = None
                cached = ep is not None
                if ep is None:
                    ep = await self._connect(addr, deadline)
                reusable = False
                try:
                    result, reusable = await self._exchange(ep, ns, hashes, idents, deadline,
                                                            sink, retry_ok=cached)
                    return result
                except _Retry:
                    self._count("stale_endpoints")
                finally:
                    if reusable and not ep.closed:
                        peer.idle.append(ep)
                    else:
                        abort_endpoint(ep)

    async def _connect(self, addr: str, deadline: float):
        import ucxx

        try:
            host, port = parse_host_port(addr, "peer address")
        except ValueError as exc:
            raise _Unreachable(str(exc)) from None
        # ucxx only notices a refused connection at its connect timeout; a plain TCP connect
        # to the listener's port says so at once.
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                               max(deadline - time.monotonic(), 0.001))
            writer.close()
        except OSError as exc:
            raise _Unreachable(f"{addr}: {exc}") from None
        ep = await ucxx.create_endpoint(host, port,
                                        connect_timeout=max(deadline - time.monotonic(), 0.001))
        self._count("connections_opened")
        lanes = endpoint_transports(ep)  # here: on the loop, with the endpoint open
        with self._lock:
            self._lanes[addr] = lanes
            if lanes is None:
                self._counters["transports_unknown"] += 1
        return ep

    async def _exchange(self, ep, ns: bytes, hashes: list[bytes], idents: list[bytes],
                        deadline: float, sink, retry_ok: bool) -> tuple[tuple, bool]:
        """One request and its answer: ((entries, targets, error), endpoint reusable)."""
        timeout_ms = max(int((deadline - time.monotonic()) * 1000), 1)
        try:
            await send_frame(ep, TAG_REQ_LEN, TAG_REQ, {
                "v": PROTOCOL_VERSION, "ns": ns, "hashes": hashes, "idents": idents,
                "timeout_ms": timeout_ms})
            header = await recv_frame(ep, TAG_RESP_LEN, TAG_RESP)
        except ProtocolError:
            raise
        except Exception:
            # A cached endpoint whose peer went away fails here, before anything was
            # received: fetches are idempotent reads, so one fresh connection may try again.
            if retry_ok:
                raise _Retry() from None
            raise
        entries, num_valid = parse_answer(header, hashes, idents, self.max_block_bytes)
        error = None
        if num_valid < len(entries):
            error = self._bad_block()
            log.warning("peer answered block %d with another hash or ident", num_valid)
        tasks: list[asyncio.Task | None] = []
        try:
            targets = await sink.reserve(entries[:num_valid])
            tasks = [asyncio.ensure_future(ep.recv(t, tag=TAG_PAYLOAD + i)) if t.nbytes else None
                     for i, t in enumerate(targets)]
            pending = [t for t in tasks if t is not None]
            if pending:
                # asyncio.wait, unlike wait_for, never cancels the receives themselves: a
                # cancelled coroutine would leave its UCX request writing into the target.
                left = deadline - time.monotonic()
                done, not_done = await asyncio.wait(pending, timeout=max(left, 0.0))
                if not_done:
                    raise TimeoutError("payloads did not arrive by the deadline")
                for task in done:
                    task.result()
        except BaseException:
            abort_endpoint(ep)  # cancels the posted receives; their targets go when they end
            sink.abandon(tasks)
            raise
        reusable = num_valid == len(entries) and len(targets) == len(entries)
        return (entries[:len(targets)], targets, error), reusable


class _Unreachable(Exception):
    """Nothing listens at the peer's address."""


class _Retry(Exception):
    """A cached endpoint turned out dead before any answer: try a fresh one."""
