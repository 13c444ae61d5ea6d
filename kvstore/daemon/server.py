"""The daemon's event loop: accepts connections, reads frames, runs verbs on worker threads.

One asyncio loop owns the sockets; every store call runs on a worker thread under the request's
deadline. A frame that cannot be read as a request gets an error reply and its connection closed;
other connections never notice. A closed connection's leases and registrations are dropped. A
request may be answered out of order: replies carry the request's id. SIGTERM/SIGINT stop the
loop, drop every connection, and close the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvstore.daemon.calls import CallContext, Deferred, ServiceError
from kvstore.daemon.service import Service
from kvstore.wire import protocol as proto
from kvstore.wire.listener import bind_unix_socket, peer_uid, socket_identity, unlink_if_ours

log = logging.getLogger("kvstore.daemon.server")

# Verbs that write into or read out of engine memory: their reply waits until the copy thread has
# stopped, so an engine that sees an error can reuse its blocks at once.
_COPY_VERBS = frozenset({"save", "load"})
# Verbs answered on the loop itself, skipping the worker-thread hop (~0.1 ms): only calls that
# never wait on IO. A lookup reads the in-memory index; the lease it takes makes it no slower. One
# that goes on to the cluster's peers returns a Deferred, run on a worker. ``resident`` and
# ``evicted`` only touch the HBM tier's index; on the loop they also keep one connection's
# publications in the order it sent them.
INLINE_VERBS = frozenset({"health", "lookup", "release", "resident", "evicted"})


class _Connection:
    def __init__(self, conn_id: int, writer: asyncio.StreamWriter, max_inflight: int) -> None:
        self.owner = f"conn-{conn_id}"
        self.writer = writer
        self.slots = asyncio.Semaphore(max_inflight)
        self.write_lock = asyncio.Lock()
        self.contexts: set[CallContext] = set()
        self.tasks: set[asyncio.Task] = set()

    async def send(self, reply: dict, max_frame_bytes: int) -> None:
        try:
            frame = proto.encode_frame(reply, max_frame_bytes)
        except proto.ProtocolError as exc:  # e.g. a get whose value outgrew the frame limit
            frame = proto.encode_frame(proto.error_reply(reply.get("id"), exc.code, exc.message))
        async with self.write_lock:
            if self.writer.is_closing():
                return
            self.writer.writelines(frame)
            with contextlib.suppress(ConnectionError):
                await self.writer.drain()


class Daemon:
    """Serves one Service on a Unix socket until stopped."""

    def __init__(self, service: Service, socket_path: Path | str, *,
                 max_frame_bytes: int = proto.MAX_FRAME_BYTES,
                 default_deadline_ms: int = proto.DEFAULT_DEADLINE_MS,
                 lease_sweep_s: float = 1.0, max_workers: int | None = None,
                 max_inflight_per_connection: int = 64,
                 allowed_uids: frozenset[int] | None = None,
                 inline_verbs: frozenset[str] = INLINE_VERBS,
                 flush_on_exit: bool = True) -> None:
        self.service = service
        self.socket_path = Path(socket_path)
        self.max_frame_bytes = max_frame_bytes
        self.default_deadline_ms = default_deadline_ms
        self.lease_sweep_s = lease_sweep_s
        self.max_inflight = max_inflight_per_connection
        self.inline_verbs = inline_verbs
        self.flush_on_exit = flush_on_exit
        self.allowed_uids = allowed_uids if allowed_uids is not None else frozenset({os.getuid()})
        self.executor = ThreadPoolExecutor(max_workers or max(8, 2 * (os.cpu_count() or 1)),
                                           thread_name_prefix="kvstore-worker")
        self._conn_ids = itertools.count(1)
        self._connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task] = set()
        self._sock = None
        self._sock_identity: tuple[int, int] | None = None
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self) -> None:
        """Create the socket now (SocketSetupError if impossible), before anything is served."""
        if self._sock is None:
            self._sock = bind_unix_socket(self.socket_path)
            self._sock_identity = socket_identity(self.socket_path)

    def run(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve until SIGTERM/SIGINT (or ``stop()``), then shut down cleanly."""
        asyncio.run(self.serve(on_ready, install_signal_handlers=True))

    def stop(self) -> None:
        """Ask a running daemon to stop; safe from any thread."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    async def serve(self, on_ready: Callable[[], None] | None = None,
                    install_signal_handlers: bool = False) -> None:
        self.bind()
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if install_signal_handlers:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(signum, self._stop.set)
        server = await asyncio.start_unix_server(self._on_connect, sock=self._sock,
                                                 limit=2**16)
        sweeper = asyncio.create_task(self._sweep_leases())
        try:
            if on_ready is not None:
                on_ready()
            await self._stop.wait()
        finally:
            sweeper.cancel()
            server.close()
            await self._drop_all_connections()
            unlink_if_ours(self.socket_path, self._sock_identity)
            self.executor.shutdown(wait=True, cancel_futures=True)
            self.service.close()
            self._close_store()

    def _close_store(self) -> None:
        store = self.service.store
        flush = getattr(store, "flush_to_ssd", None)
        if self.flush_on_exit and flush is not None:
            # A graceful stop keeps DRAM-only blocks too: a restart from the same SSD dir has them.
            try:
                num_written = flush()
                log.info("flushed %d block(s) to SSD before exit", num_written)
            except Exception:
                log.exception("flush to SSD at exit failed")
        store.close()

    async def _drop_all_connections(self) -> None:
        for conn in list(self._connections):
            for ctx in conn.contexts:
                ctx.cancel()
            conn.writer.close()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=10.0)

    async def _sweep_leases(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.lease_sweep_s)
            try:
                await loop.run_in_executor(self.executor, self.service.expire_leases)
            except Exception:
                log.exception("lease sweep failed")

    # ------------------------------------------------------------------------- connections

    async def _on_connect(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._handlers.add(task)
        try:
            await self._serve_connection(reader, writer)
        finally:
            self._handlers.discard(task)

    async def _serve_connection(self, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        conn = _Connection(next(self._conn_ids), writer, self.max_inflight)
        uid = peer_uid(writer.get_extra_info("socket"))
        if uid not in self.allowed_uids:
            self.service.count("connect", proto.PERMISSION_DENIED)
            await conn.send(proto.error_reply(None, proto.PERMISSION_DENIED,
                                              f"peer uid {uid} may not use this daemon"),
                            self.max_frame_bytes)
            writer.close()
            return
        self._connections.add(conn)
        self.service.open_owner(conn.owner)
        try:
            await self._read_requests(reader, conn)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._connections.discard(conn)
            for ctx in conn.contexts:
                ctx.cancel()  # an engine that died needs no more copies
            # Leases and mappings go now; copies still running finish their current block first.
            await asyncio.get_running_loop().run_in_executor(
                None, self.service.drop_owner, conn.owner)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read_requests(self, reader: asyncio.StreamReader, conn: _Connection) -> None:
        while True:
            try:
                header = await reader.readexactly(proto.HEADER_BYTES)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    await self._refuse(conn, None, proto.MALFORMED_FRAME, "truncated frame header")
                return
            received_at = time.monotonic()  # the deadline runs from here
            try:
                length = proto.frame_length(header, self.max_frame_bytes)
                body = await reader.readexactly(length)
            except proto.ProtocolError as exc:  # oversized: the body is never read
                await self._refuse(conn, None, exc.code, exc.message)
                return
            except asyncio.IncompleteReadError:
                return  # the peer went away mid-frame; nobody to answer
            try:
                request = proto.parse_request(proto.decode_body(body, check_plain=False),
                                              self.default_deadline_ms)
            except proto.ProtocolError as exc:
                if exc.code == proto.MALFORMED_FRAME:
                    await self._refuse(conn, exc.request_id, exc.code, exc.message)
                    return
                self.service.count("invalid", exc.code)
                await conn.send(proto.error_reply(exc.request_id, exc.code, exc.message),
                                self.max_frame_bytes)
                continue
            await conn.slots.acquire()  # backpressure: stop reading at max in-flight requests
            task = asyncio.create_task(self._answer(conn, request, received_at))
            conn.tasks.add(task)
            task.add_done_callback(conn.tasks.discard)

    async def _refuse(self, conn: _Connection, request_id: int | None, code: str,
                      message: str) -> None:
        self.service.count("invalid", code)
        await conn.send(proto.error_reply(request_id, code, message + "; closing the connection"),
                        self.max_frame_bytes)

    # ---------------------------------------------------------------------------- requests

    async def _answer(self, conn: _Connection, request: proto.Request,
                      received_at: float) -> None:
        deadline = received_at + request.deadline_ms / 1000.0
        timeout_s = max(0.0, deadline - time.monotonic())
        ctx = CallContext(owner=conn.owner, deadline=deadline,
                          on_loop=request.verb in self.inline_verbs)
        conn.contexts.add(ctx)
        try:
            try:
                reply = await self._execute(request, ctx, timeout_s)
            except Exception as exc:  # never leave a client waiting on a reply that cannot come
                log.exception("%s failed", request.verb)
                reply = proto.error_reply(request.request_id, proto.INTERNAL, repr(exc))
            finally:
                conn.contexts.discard(ctx)
            error = reply["error"]["code"] if not reply["ok"] else None
            self.service.count(request.verb, error, time.monotonic() - received_at)
            await conn.send(reply, self.max_frame_bytes)
        finally:
            # Held until the reply is written out: a client that stops reading stalls only its
            # own connection (at max in-flight requests), never the daemon's memory.
            conn.slots.release()

    async def _execute(self, request: proto.Request, ctx: CallContext,
                       timeout_s: float) -> dict[str, Any]:
        rid = request.request_id
        try:
            if ctx.on_loop:
                result = self.service.call(request.verb, request.args, ctx)
                if not isinstance(result, Deferred):
                    return proto.ok_reply(rid, result)
                try:
                    future = asyncio.get_running_loop().run_in_executor(self.executor,
                                                                        result.run)
                except BaseException:  # shutting down: nobody will run it
                    result.abandon()
                    raise
            else:
                future = asyncio.get_running_loop().run_in_executor(
                    self.executor, self.service.call, request.verb, request.args, ctx)
            try:
                result = await asyncio.wait_for(asyncio.shield(future), timeout_s)
            except asyncio.TimeoutError:
                ctx.cancel()
                if request.verb in _COPY_VERBS:
                    # Not a byte may move after the engine hears "failed": wait for the copy to
                    # stop at its next block boundary.
                    with contextlib.suppress(Exception):
                        await future
                else:
                    future.add_done_callback(self._cleanup_abandoned)
                return proto.error_reply(rid, proto.DEADLINE_EXCEEDED,
                                         f"{request.verb} missed its {request.deadline_ms} ms "
                                         "deadline")
            return proto.ok_reply(rid, result)
        except ServiceError as exc:
            return proto.error_reply(rid, exc.code, exc.message)
        except RuntimeError as exc:
            if "shutdown" in str(exc):  # the executor is closing
                return proto.error_reply(rid, proto.SHUTTING_DOWN, "the daemon is shutting down")
            log.exception("%s failed", request.verb)
            return proto.error_reply(rid, proto.INTERNAL, f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            log.exception("%s failed", request.verb)
            return proto.error_reply(rid, proto.INTERNAL, f"{type(exc).__name__}: {exc}")

    def _cleanup_abandoned(self, future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        with contextlib.suppress(RuntimeError):  # shutting down: service.close() releases all
            self.executor.submit(self.service.release_abandoned, future.result())
