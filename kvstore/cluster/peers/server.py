"""Serves this daemon's blocks to peers over UCX (the protocol is in ``transport.py``).

Each request is answered from the local store: a lookup with the client's idents (a hit is
verified at the owner), under a lease held until the payloads are sent, then a header and the
payloads of the verified prefix, read from DRAM without a copy. From the first view taken until
the last payload left, the lease is being read (``BlockStore.reading``): it neither expires nor
lets go of its blocks, so no save reuses memory UCX still sends from. Where the store's prefix
falls short, a ``stage`` callable (the daemon's HBM tier: blocks only an engine's arena holds)
may put the next blocks into the store first. Store calls run on worker threads so the shared
UCX loop never waits on a lock or a disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

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
    parse_request,
    recv_frame,
    send_frame,
)
from kvstore.cluster.ucx.runtime import UcxRuntime
from kvstore.store.block_store import BlockStore, BlockUnavailable, Lease, StoreError

log = logging.getLogger(__name__)

_LEASE_SLACK_S = 1.0
# (namespace, hashes, idents, start, deadline) -> how many blocks from ``start`` the store
# holds now: see HbmTier.stage.
Stage = Callable[[bytes, Sequence[bytes], Sequence[bytes], int, float], int]


def _stage_nothing(ns: bytes, hashes: Sequence[bytes], idents: Sequence[bytes], start: int,
                   deadline: float) -> int:
    """The stage until one is given: the store's prefix is the answer."""
    return 0


@dataclass
class PeerAnswer:
    """What one request is answered with: the verified prefix's DRAM ``views`` and their
    header ``entries``, read under ``lease``. Until ``close`` the lease is being read (it
    neither expires nor lets go of its blocks); after it the views must not be used."""

    lease: Lease | None = None
    views: list[memoryview] = field(default_factory=list)
    entries: list[list] = field(default_factory=list)
    reading: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def close(self) -> None:
        """The payloads left (or never will): end the reading, then release the lease."""
        self.reading.close()
        if self.lease is not None:
            self.lease.release()
            self.lease = None


class PeerServer:
    """Serves fetches of the local store's blocks to peers on ``host:port`` (0: a free port).

    ucxx 0.52 listeners take only a port: the port is bound on every interface, whatever ``host``.
    """

    def __init__(self, store: BlockStore, host: str, port: int, max_blocks_per_fetch: int = 4096,
                 num_workers: int = 4) -> None:
        self.store = store
        self.host = host
        self.requested_port = port
        self.port = 0
        self.max_blocks_per_fetch = max_blocks_per_fetch
        self._runtime: UcxRuntime | None = None
        self._listener = None
        self._endpoints: set = set()
        self._tasks: set[asyncio.Task] = set()
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="kvstore-peer-serve")
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self._closed = False
        self._stage: Stage = _stage_nothing

    def extend_with(self, stage: Stage) -> None:
        """Where the store's prefix of a request falls short, ask ``stage`` to store the next
        blocks (from engines' arenas) before answering."""
        self._stage = stage

    def start(self) -> int:
        """Listen; returns the bound port."""
        self._runtime = UcxRuntime.acquire()
        try:
            self.port = self._runtime.call(self._listen(), 10.0)
        except BaseException:
            self._runtime.release()
            self._runtime = None
            raise
        return self.port

    async def _listen(self) -> int:
        import ucxx

        self._listener = ucxx.create_listener(self._on_connect, port=self.requested_port)
        return self._listener.port

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop listening, drop every connection and release their leases. Idempotent."""
        if self._runtime is None or self._closed:
            return
        self._closed = True
        try:
            self._runtime.call(self._shutdown(timeout_s), timeout_s + 1.0)
        except Exception as exc:
            log.warning("peer server did not stop cleanly: %s", exc)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._runtime.release()
        self._runtime = None

    async def _shutdown(self, timeout_s: float) -> None:
        for ep in list(self._endpoints):
            abort_endpoint(ep)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
        await asyncio.sleep(0)  # let ucxx retire the finished handlers
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def stats(self) -> dict:
        with self._lock:
            return {"connections": len(self._endpoints), **self._counters}

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    async def _on_connect(self, ep) -> None:
        if self._closed:
            abort_endpoint(ep)
            return
        task = asyncio.current_task()
        self._endpoints.add(ep)
        if task is not None:
            self._tasks.add(task)
        self._count("connections_accepted")
        try:
            while not self._closed:
                try:
                    request = await recv_frame(ep, TAG_REQ_LEN, TAG_REQ)
                except Exception:
                    break  # the peer went away (or spoke garbage): end this connection
                if not await self._serve(ep, request):
                    break
        except asyncio.CancelledError:
            pass
        finally:
            self._endpoints.discard(ep)
            if task is not None:
                self._tasks.discard(task)
            abort_endpoint(ep)

    async def _serve(self, ep, request: object) -> bool:
        """Answer one request; False when the connection must end."""
        try:
            ns, hashes, idents, timeout_s = parse_request(request, self.max_blocks_per_fetch)
        except ProtocolError as exc:
            self._count("bad_requests")
            with contextlib.suppress(Exception):
                await send_frame(ep, TAG_RESP_LEN, TAG_RESP,
                                 {"v": PROTOCOL_VERSION, "blocks": [], "error": str(exc)})
            return False
        loop = asyncio.get_running_loop()
        try:
            answer = await loop.run_in_executor(
                self._executor, self.read_blocks, ns, hashes, idents, timeout_s)
        except Exception as exc:  # the store is closing: end the connection
            log.warning("peer fetch: reading blocks failed: %s", exc)
            return False
        try:
            header = {"v": PROTOCOL_VERSION, "blocks": answer.entries, "error": None}
            await asyncio.wait_for(self._send_answer(ep, header, answer.views), timeout_s)
            self._count("requests")
            self._count("blocks_sent", len(answer.views))
            self._count("bytes_sent", sum(v.nbytes for v in answer.views))
            return True
        except Exception:
            self._count("send_errors")
            return False
        finally:
            answer.close()

    def read_blocks(self, ns: bytes, hashes: list[bytes], idents: list[bytes],
                    timeout_s: float) -> PeerAnswer:
        """On a worker thread: the verified prefix, its DRAM views and their header entries,
        under a lease being read until the answer is closed."""
        deadline = time.monotonic() + timeout_s / 2  # half for staging, the rest to send
        try:
            result = self.store.lookup(ns, hashes, idents, lease_ttl_s=timeout_s + _LEASE_SLACK_S,
                                       owner="peer")
            if result.num_hit < len(hashes):
                result = self._staged(ns, hashes, idents, result, deadline, timeout_s)
        except StoreError as exc:
            log.warning("peer fetch: store lookup failed: %s", exc)
            return PeerAnswer()
        if result.lease is None:
            return PeerAnswer()
        answer = PeerAnswer(result.lease)
        try:
            answer.reading.enter_context(self.store.reading(result.lease))
            for i in range(result.num_hit):
                try:
                    view = self.store.read(result.lease, i)
                except (BlockUnavailable, StoreError):
                    break  # the answer shrinks before a block that cannot be produced
                answer.views.append(view)
                answer.entries.append([hashes[i], idents[i], view.nbytes, checksum(view)])
        except BaseException:
            answer.close()
            raise
        return answer

    def _staged(self, ns: bytes, hashes: list[bytes], idents: list[bytes], local, deadline: float,
                timeout_s: float):
        """``local``, or a longer hit once ``stage`` stored blocks past it (``local``'s lease
        pins its prefix until the new lookup's does)."""
        try:
            num_staged = self._stage(ns, hashes, idents, local.num_hit, deadline)
        except Exception:  # staging never fails the answer: it just stays the store's prefix
            log.exception("peer fetch: staging from engines' arenas failed")
            return local
        if not num_staged:
            return local
        self._count("blocks_staged", num_staged)
        try:
            return self.store.lookup(ns, hashes, idents, lease_ttl_s=timeout_s + _LEASE_SLACK_S,
                                     owner="peer")
        finally:
            if local.lease is not None:
                local.lease.release()

    async def _send_answer(self, ep, header: dict, views: list[memoryview]) -> None:
        await send_frame(ep, TAG_RESP_LEN, TAG_RESP, header)
        # Posted in order on distinct tags; UCX may overlap them on the wire.
        await asyncio.gather(*(ep.send(view, tag=TAG_PAYLOAD + i)
                               for i, view in enumerate(views) if view.nbytes))
