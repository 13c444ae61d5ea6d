"""Blocks between daemons over UCX: a ``PeerServer`` that serves fetches from the local store and
a ``PeerClient`` that fetches from peers, with cached endpoints and a deadline on every read.

One endpoint carries one request at a time. Every message is tagged (ints only: ucxx hashes the
tag, and Python's str hash differs between processes):

    client → server   REQ_LEN (u64 LE)  REQ     msgpack {v, ns, hashes, idents, timeout_ms}
    server → client   RESP_LEN (u64 LE) RESP    msgpack {v, blocks: [[hash, ident, nbytes, xxh3]],
                                                         error}
    server → client   PAYLOAD + i       the bytes of block i, for each entry of ``blocks``

The server looks the blocks up in its store with the client's idents (a hit is verified at the
owner) under a lease, and answers with the prefix it holds. The client checks each entry against
what it asked for and each payload against its XXH3-64; the first block that fails ends the
answer (a miss plus a counted error), so wrong bytes are never returned. Any protocol surprise,
deadline or transport error drops the endpoint: its late messages cannot confuse a later request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgpack
import numpy as np
import xxhash

from kvstore.block_store import BlockStore, BlockUnavailable, StoreError
from kvstore.cluster_config import parse_host_port
from kvstore.keys import HASH_BYTES
from kvstore.ucx_runtime import UcxRuntime

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 64 << 20
TAG_REQ_LEN, TAG_REQ, TAG_RESP_LEN, TAG_RESP = 1, 2, 3, 4
TAG_PAYLOAD = 1 << 32
_ABORT_PERIOD_NS = 100_000_000  # how long dropping an endpoint may wait for UCX to let go
_LEASE_SLACK_S = 1.0


def checksum(data: memoryview | bytes | np.ndarray) -> int:
    """The per-block payload checksum (XXH3-64)."""
    return xxhash.xxh3_64_intdigest(data)


async def send_frame(ep, tag_len: int, tag_body: int, obj: object) -> None:
    """One msgpack frame: its length (u64 LE) then its bytes, as two tagged messages."""
    body = np.frombuffer(msgpack.packb(obj, use_bin_type=True), dtype=np.uint8)
    await ep.send(np.array([body.nbytes], dtype="<u8"), tag=tag_len)
    if body.nbytes:
        await ep.send(body, tag=tag_body)


async def recv_frame(ep, tag_len: int, tag_body: int) -> object:
    """The counterpart of ``send_frame``; ValueError on a length over MAX_HEADER_BYTES."""
    length = np.empty(1, dtype="<u8")
    await ep.recv(length, tag=tag_len)
    num_bytes = int(length[0])
    if num_bytes > MAX_HEADER_BYTES:
        raise ValueError(f"frame of {num_bytes} B is over the {MAX_HEADER_BYTES} B limit")
    body = np.empty(num_bytes, dtype=np.uint8)
    if num_bytes:
        await ep.recv(body, tag=tag_body)
    return msgpack.unpackb(body.tobytes(), raw=False)


def _abort(ep) -> None:
    with contextlib.suppress(Exception):
        ep.abort(period=_ABORT_PERIOD_NS, max_attempts=1)


# -- server ------------------------------------------------------------------------------------


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
            _abort(ep)
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
            _abort(ep)
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
            _abort(ep)

    async def _serve(self, ep, request: object) -> bool:
        """Answer one request; False when the connection must end."""
        try:
            ns, hashes, idents, timeout_s = self._parse_request(request)
        except (TypeError, ValueError, KeyError) as exc:
            self._count("bad_requests")
            with contextlib.suppress(Exception):
                await send_frame(ep, TAG_RESP_LEN, TAG_RESP,
                                 {"v": PROTOCOL_VERSION, "blocks": [], "error": str(exc)})
            return False
        loop = asyncio.get_running_loop()
        try:
            lease, views, entries = await loop.run_in_executor(
                self._executor, self._read_blocks, ns, hashes, idents, timeout_s)
        except Exception as exc:  # the store is closing: end the connection
            log.warning("peer fetch: reading blocks failed: %s", exc)
            return False
        try:
            header = {"v": PROTOCOL_VERSION, "blocks": entries, "error": None}
            await asyncio.wait_for(self._send_answer(ep, header, views), timeout_s)
            self._count("requests")
            self._count("blocks_sent", len(views))
            self._count("bytes_sent", sum(v.nbytes for v in views))
            return True
        except Exception:
            self._count("send_errors")
            return False
        finally:
            if lease is not None:
                lease.release()

    def _parse_request(self, request: object) -> tuple[bytes, list[bytes], list[bytes], float]:
        if not isinstance(request, dict) or request.get("v") != PROTOCOL_VERSION:
            raise ValueError("unsupported request version")
        ns, hashes, idents = request["ns"], request["hashes"], request["idents"]
        if not isinstance(ns, bytes) or len(ns) != HASH_BYTES:
            raise ValueError("bad namespace")
        if not isinstance(hashes, list) or not isinstance(idents, list) or (
                len(hashes) != len(idents)):
            raise ValueError("hashes and idents must be lists of equal length")
        if len(hashes) > self.max_blocks_per_fetch:
            raise ValueError(f"at most {self.max_blocks_per_fetch} blocks per fetch")
        if any(not isinstance(h, bytes) or len(h) != HASH_BYTES for h in hashes) or any(
                not isinstance(i, bytes) for i in idents):
            raise ValueError("bad block hash or ident")
        timeout_s = min(max(float(request.get("timeout_ms", 2000)) / 1000, 0.001), 60.0)
        return ns, hashes, idents, timeout_s

    def _read_blocks(self, ns: bytes, hashes: list[bytes], idents: list[bytes], timeout_s: float):
        """On a worker thread: the verified prefix, its DRAM views and their header entries."""
        try:
            result = self.store.lookup(ns, hashes, idents, lease_ttl_s=timeout_s + _LEASE_SLACK_S,
                                       owner="peer")
        except StoreError as exc:
            log.warning("peer fetch: store lookup failed: %s", exc)
            return None, [], []
        if result.lease is None:
            return None, [], []
        views: list[memoryview] = []
        entries: list[list] = []
        for i in range(result.num_hit):
            try:
                view = self.store.read(result.lease, i)
            except (BlockUnavailable, StoreError):
                break  # the answer shrinks before a block that cannot be produced
            views.append(view)
            entries.append([hashes[i], idents[i], view.nbytes, checksum(view)])
        return result.lease, views, entries

    async def _send_answer(self, ep, header: dict, views: list[memoryview]) -> None:
        await send_frame(ep, TAG_RESP_LEN, TAG_RESP, header)
        # Posted in order on distinct tags; UCX may overlap them on the wire.
        await asyncio.gather(*(ep.send(view, tag=TAG_PAYLOAD + i)
                               for i, view in enumerate(views) if view.nbytes))


# -- client ------------------------------------------------------------------------------------


@dataclass
class FetchResult:
    """The verified prefix of blocks a peer sent, and why it stopped short.

    ``blocks`` are read-only views into a receive buffer that is reused once the result is
    released: use it as a context manager, or call ``release()``, after copying the blocks out.
    An unreleased result just leaves its buffer to the garbage collector.
    """

    blocks: list[memoryview]
    error: str | None = None  # None, or the kind of failure counted in PeerClient.stats()
    _buffer: np.ndarray | None = field(default=None, repr=False)
    _pool: _BufferPool | None = field(default=None, repr=False)

    def release(self) -> None:
        """Give the receive buffer back; the views must not be used after this."""
        for view in self.blocks:
            with contextlib.suppress(BufferError):  # still exported: the contract alone holds
                view.release()
        self.blocks = []
        if self._pool is not None and self._buffer is not None:
            self._pool.put(self._buffer)
        self._buffer = self._pool = None

    def __enter__(self) -> FetchResult:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _BufferPool:
    """Receive buffers kept for reuse: fresh memory costs a page fault per 4 KiB on first touch,
    which on a fast link costs more than the transfer. Thread-safe; bounded in bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def get(self, num_bytes: int) -> np.ndarray:
        with self._lock:
            fits = [b for b in self._free if num_bytes <= b.nbytes <= 2 * num_bytes + (1 << 20)]
            if fits:
                best = min(fits, key=lambda b: b.nbytes)
                self._free.remove(best)
                return best
        return np.empty(-(-num_bytes // (1 << 20)) << 20, dtype=np.uint8)  # whole MiBs

    def put(self, buffer: np.ndarray) -> None:
        with self._lock:
            self._free.append(buffer)
            total = sum(b.nbytes for b in self._free)
            while self._free and total > self.max_bytes:
                total -= self._free.pop(0).nbytes  # the oldest goes first


@dataclass
class _Peer:
    idle: list = field(default_factory=list)
    slots: asyncio.Semaphore | None = None


class PeerError(Exception):
    """A failed fetch; ``kind`` is the counter it lands in."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class PeerClient:
    """Fetches blocks from peers with a per-peer pool of cached UCX endpoints.

    ``fetch`` is synchronous (the daemon calls it from worker threads); the transfer runs on the
    shared UCX loop. Every fetch ends by its deadline; failure kinds are counted.
    """

    def __init__(self, endpoints_per_peer: int = 4, max_block_bytes: int = 1 << 30,
                 buffer_pool_bytes: int = 1 << 30) -> None:
        self.endpoints_per_peer = endpoints_per_peer
        self.max_block_bytes = max_block_bytes
        self._buffers = _BufferPool(buffer_pool_bytes)
        self._runtime: UcxRuntime | None = None
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self._seq = itertools.count(1)

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
                _abort(ep)
            peer.idle.clear()
        self._peers.clear()

    def stats(self) -> dict:
        with self._lock:
            return dict(self._counters)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def fetch(self, addr: str, namespace: bytes, block_hashes: Sequence[bytes],
              idents: Sequence[bytes], deadline: float) -> FetchResult:
        """The longest verified prefix of the blocks that the peer at ``addr`` sends back by
        ``deadline`` (``time.monotonic()`` seconds). Never raises for peer trouble.
        """
        if self._runtime is None:
            raise RuntimeError("PeerClient.start() first")
        if len(block_hashes) != len(idents):
            raise ValueError("block_hashes and idents differ in length")
        if not block_hashes:
            return FetchResult([])
        timeout_s = deadline - time.monotonic()
        if timeout_s <= 0:
            return self._failed("timeout")
        future = self._runtime.submit(asyncio.wait_for(
            self._fetch(addr, namespace, list(block_hashes), list(idents), timeout_s), timeout_s))
        try:
            entries, views, buffer, mismatch = future.result(timeout_s + 0.5)
        except (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            return self._failed("timeout")
        except PeerError as exc:
            log.info("fetch from %s failed (%s): %s", addr, exc.kind, exc)
            return self._failed(exc.kind)
        except Exception as exc:  # a transport error: UCX raises its own types
            future.cancel()
            log.info("fetch from %s failed: %s: %s", addr, type(exc).__name__, exc)
            return self._failed("transport")
        result = self._verify(entries, views)
        result._buffer, result._pool = buffer, self._buffers
        if mismatch and result.error is None:
            result.error = "bad_block"
        return result

    def _failed(self, kind: str) -> FetchResult:
        self._count(f"errors_{kind}")
        return FetchResult([], kind)

    def _verify(self, entries: list[list], views: list[memoryview]) -> FetchResult:
        """On the caller's thread: keep blocks up to the first whose checksum fails."""
        good: list[memoryview] = []
        error = None
        for entry, view in zip(entries, views):
            if checksum(view) != entry[3]:
                error = "bad_block"
                self._count("errors_bad_block")
                break
            good.append(view.toreadonly())
        self._count("blocks_received", len(good))
        self._count("bytes_received", sum(v.nbytes for v in good))
        return FetchResult(good, error)

    async def _fetch(self, addr: str, ns: bytes, hashes: list[bytes], idents: list[bytes],
                     timeout_s: float) -> tuple[list[list], list[memoryview], np.ndarray, bool]:
        deadline = time.monotonic() + timeout_s
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
                        _abort(ep)
                        ep = None
                cached = ep is not None
                if ep is None:
                    ep = await self._connect(addr, deadline)
                reusable = False
                try:
                    result, reusable = await self._exchange(ep, ns, hashes, idents, deadline)
                    return result
                except PeerError:
                    raise
                except Exception:
                    if not cached:
                        raise
                    # The peer closed this cached endpoint (it restarted, say): fetches are
                    # idempotent reads, so try once more on a fresh connection.
                    self._count("stale_endpoints")
                finally:
                    if reusable and not ep.closed:
                        peer.idle.append(ep)
                    else:
                        _abort(ep)

    async def _connect(self, addr: str, deadline: float):
        import ucxx

        host, port = parse_host_port(addr, "peer address")
        # ucxx only notices a refused connection at its connect timeout; a plain TCP connect
        # to the listener's port says so at once.
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                               max(deadline - time.monotonic(), 0.001))
            writer.close()
        except OSError as exc:
            raise PeerError("unreachable", f"{addr}: {exc}") from None
        ep = await ucxx.create_endpoint(host, port,
                                        connect_timeout=max(deadline - time.monotonic(), 0.001))
        self._count("connections_opened")
        return ep

    async def _exchange(self, ep, ns: bytes, hashes: list[bytes], idents: list[bytes],
                        deadline: float) -> tuple[tuple, bool]:
        """One request and its answer: ((entries, views, buffer, an entry mismatched),
        reusable). The buffer comes from the pool; on any failure it is dropped, never reused,
        since UCX may still write into it."""
        timeout_ms = max(int((deadline - time.monotonic()) * 1000), 1)
        await send_frame(ep, TAG_REQ_LEN, TAG_REQ, {
            "v": PROTOCOL_VERSION, "ns": ns, "hashes": hashes, "idents": idents,
            "timeout_ms": timeout_ms})
        try:
            header = await recv_frame(ep, TAG_RESP_LEN, TAG_RESP)
        except ValueError as exc:
            raise PeerError("protocol", str(exc)) from None
        if not isinstance(header, dict) or header.get("v") != PROTOCOL_VERSION:
            raise PeerError("protocol", "unsupported answer version")
        if header.get("error"):
            raise PeerError("refused", str(header["error"]))
        entries = header.get("blocks")
        if not isinstance(entries, list) or len(entries) > len(hashes):
            raise PeerError("protocol", "answer lists more blocks than asked for")
        # Take the entries that match what was asked; a mismatch ends the answer. The payloads
        # of all announced blocks are still received so the endpoint stays in step.
        sizes: list[int] = []
        num_valid = len(entries)
        for i, entry in enumerate(entries):
            if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[2], int)
                    and 0 <= entry[2] <= self.max_block_bytes and isinstance(entry[3], int)):
                raise PeerError("protocol", f"malformed entry {i}")
            if num_valid == len(entries) and (entry[0] != hashes[i] or entry[1] != idents[i]):
                num_valid = i
            sizes.append(entry[2])
        buffer = self._buffers.get(sum(sizes))
        views: list[memoryview] = []
        offset = 0
        for size in sizes:
            views.append(memoryview(buffer[offset:offset + size]))
            offset += size
        await asyncio.gather(*(ep.recv(view, tag=TAG_PAYLOAD + i)
                               for i, view in enumerate(views) if view.nbytes))
        if num_valid < len(entries):
            self._count("errors_bad_block")
            log.warning("peer answered block %d with another hash or ident", num_valid)
        return (entries[:num_valid], views[:num_valid], buffer, num_valid < len(entries)), True
