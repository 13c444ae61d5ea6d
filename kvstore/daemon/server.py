"""The daemon's event loop: accepts connections, reads frames, runs verbs on worker threads.

One asyncio loop owns the sockets; every store call runs on a worker thread under the request's
deadline. A frame that cannot be read as a request gets an error reply and its connection closed;
other connections never notice. A closed connection's leases and registrations are dropped. A
request may be answered out of order: replies carry the request's id. SIGTERM/SIGINT stop the
loop, drop every connection, and close the store.

What clients may hold is bounded (``limits.py``): connections are capped at accept
(``accept.py``), a frame's body counts against a global buffer budget as it arrives and
must arrive within a timeout, a connection runs one ``get`` at a time until its value is
written out, and the watch (``watch.py``) closes slow readers, idle connections and,
when the budget is spent, those holding more than their share.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from kvstore.daemon import memory
from kvstore.daemon.accept import Acceptor
from kvstore.daemon.calls import CallContext, Deferred, ServiceError
from kvstore.daemon.connection import BULK_REPLY_VERBS, FD_VERBS, Connection, encode_reply
from kvstore.daemon.direct_reply import DirectReply
from kvstore.daemon.frame_body import BodyRoom, NoRoom, read_body
from kvstore.daemon.health import LoopHeartbeat
from kvstore.daemon.limits import ConnectionLimits
from kvstore.daemon.service import Service
from kvstore.daemon.watch import CLOSE_REASONS, ConnectionWatch
from kvstore.daemon.worker_call import WorkerCall
from kvstore.engines.cuda_fault import EXIT_CUDA_POISONED
from kvstore.key_filter import key_filter_path
from kvstore.rate_limited_log import RateLimitedLog
from kvstore.wire import protocol as proto
from kvstore.wire.fds import FdError, FdSocket, FrameFds
from kvstore.wire.listener import bind_unix_socket, peer_uid, socket_identity, unlink_if_ours
from kvstore.wire.socket_access import SocketAccess

log = logging.getLogger("kvstore.daemon.server")

# Verbs that write into or read out of engine memory: their reply waits until the copy thread has
# stopped, so an engine that sees an error can reuse its blocks at once.
_COPY_VERBS = frozenset({"save", "load", "lookup_load"})
# Verbs answered on the loop itself, skipping the worker-thread hop (~0.1 ms): only calls that
# never wait on IO. A lookup reads the in-memory index; the lease it takes makes it no slower. One
# that goes on to the cluster's peers returns a Deferred, run on a worker. ``locate`` reads the
# same indexes as a lookup and never asks peers; a router waits for it in front of every request
# (on a worker it also queued behind the engines' saves). ``resident`` and ``evicted`` only touch
# the HBM tier's index; on the loop they also keep one connection's publications in the order it
# sent them.
INLINE_VERBS = frozenset({"hello", "health", "engines", "lookup", "locate", "release",
                          "resident", "evicted"})
# Inline verbs that stay on the loop whatever their size: their order is their meaning.
_ORDERED_VERBS = frozenset({"resident", "evicted"})
# Frames up to this size are read without asking the buffer budget: requests, not payloads.
_SMALL_FRAME_BYTES = 64 * 1024
# Frames up to this size are read whole, decoded on the loop, and an inline verb's is answered
# there: a chain of ~2,500 blocks (a 40k-token prompt, 100 bytes a block) decodes in ~20 us and
# is located in well under a millisecond. Past 64 KiB (a 19k-token prompt's locate is 120 KB)
# the decode and the call each took a worker thread, behind the engines' saves: on two H200s a
# router's locates of first turns waited 25-80 ms while the engines saved, ~2.4 ms when idle.
_INLINE_FRAME_BYTES = 256 * 1024
# A poisoned CUDA context: how long /health answers "failing" before the daemon exits.
POISONED_EXIT_GRACE_S = 2.0
_LOG_INTERVAL_S = 10.0  # a repeated warning or error is logged once per this, with a count
# How a request ends when its client is gone before the reply (counted; no client sees it).
_CLIENT_GONE = "client_gone"


def request_start(request: proto.Request, received_at: float) -> float:
    """When a request's deadline starts: when its client sent it, if it said so on our clock
    (never later than we read it), else when we read it. A frame that waited in the socket
    while this daemon was stopped must not get its whole deadline again: the client gave up on
    it meanwhile and may have reused the memory a save would copy from."""
    if request.sent_mono is None:
        return received_at
    return min(received_at, request.sent_mono)


def answered_on_loop(verb: str, body_bytes: int,
                     inline_verbs: frozenset[str] = INLINE_VERBS) -> bool:
    """Whether a request is answered on the event loop (no thread hop): an inline verb's of at
    most ``_INLINE_FRAME_BYTES``, or one whose order among its connection's publications
    matters, whatever its size. A longer chain goes to a worker so as not to stall the other
    clients."""
    return verb in inline_verbs and (body_bytes <= _INLINE_FRAME_BYTES
                                     or verb in _ORDERED_VERBS)


class Daemon:
    """Serves one Service on a Unix socket until stopped."""

    def __init__(self, service: Service, socket_path: Path | str, *,
                 max_frame_bytes: int = proto.MAX_FRAME_BYTES,
                 default_deadline_ms: int = proto.DEFAULT_DEADLINE_MS,
                 lease_sweep_s: float = 1.0, max_workers: int | None = None,
                 max_inflight_per_connection: int = 64,
                 allowed_uids: frozenset[int] | None = None,
                 inline_verbs: frozenset[str] = INLINE_VERBS,
                 flush_on_exit: bool = True,
                 limits: ConnectionLimits | None = None,
                 debug_stall_s: float | None = None,
                 access: SocketAccess | None = None) -> None:
        """``debug_stall_s`` (tests only, ``KVSTORE_DEBUG_STALL_ON_SIGUSR2``): SIGUSR2 blocks
        the loop this long, as a slow synchronous call on it would."""
        self.service = service
        # the admin thread's view of this loop, and each tick's lateness in the stats
        self.heartbeat = LoopHeartbeat(stalls=self.service.stalls)
        self.debug_stall_s = debug_stall_s
        self.socket_path = Path(socket_path)
        self.max_frame_bytes = max_frame_bytes
        self.default_deadline_ms = default_deadline_ms
        self.lease_sweep_s = lease_sweep_s
        self.max_inflight = max_inflight_per_connection
        self.inline_verbs = inline_verbs
        self.flush_on_exit = flush_on_exit
        self.allowed_uids = allowed_uids if allowed_uids is not None else frozenset({os.getuid()})
        self.access = access or SocketAccess.of()  # with a group, its processes are let in too
        self.executor = ThreadPoolExecutor(max_workers or max(8, 2 * (os.cpu_count() or 1)),
                                           thread_name_prefix="kvstore-worker")
        self.limits = limits if limits is not None else ConnectionLimits()
        self._watch = ConnectionWatch(self.limits, self._count_event)
        self._conn_ids = itertools.count(1)
        self._connections: set[Connection] = set()
        self._large_frames: list[BodyRoom] = []  # being read, oldest first
        self._num_open = 0  # accepted and not yet closed, counted from accept on
        self._handlers: set[asyncio.Task] = set()
        # Whatever clients do, the log grows by a few lines per interval at most: one line per
        # kind of failure (a verb or the lease sweep, and the exception's type) and of reclaim.
        self._log = RateLimitedLog(log, _LOG_INTERVAL_S)
        self._sock = None
        self._sock_identity: tuple[int, int] | None = None
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.exit_code = 0  # what ``kvstore serve`` exits with once ``run`` returns
        service.registry.cuda_fault.add_listener(self._on_cuda_poisoned)
        # copy verbs' replies their worker wrote, or encoded and left to the loop (the wire
        # had unsent bytes): ``direct_reply.py``
        service.counters.declare(("replies_by_worker", "replies_by_worker_declined"))

    def bind(self) -> None:
        """Create the socket now (SocketSetupError if impossible), before anything is served."""
        if self._sock is None:
            self._sock = bind_unix_socket(self.socket_path, access=self.access)
            self._sock_identity = socket_identity(self.socket_path)
            # beside the socket, in its directory: engines map it (``kvstore/key_filter.py``)
            self.service.open_key_filter(key_filter_path(self.socket_path),
                                         self.access.group_id)

    def run(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve until SIGTERM/SIGINT (or ``stop()``), then shut down cleanly."""
        asyncio.run(self.serve(on_ready, install_signal_handlers=True))

    def stop(self, after_s: float = 0.0) -> None:
        """Ask a running daemon to stop (in ``after_s``); safe from any thread."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, after_s, self._stop.set)

    def _on_cuda_poisoned(self, reason: str) -> None:
        """Fail closed: health says failing at once, the daemon exits with a code of its own
        for its supervisor after ``POISONED_EXIT_GRACE_S`` (long enough for probes to see why)."""
        self.exit_code = EXIT_CUDA_POISONED
        log.critical("stopping in %.1f s with exit status %d: restart the daemon (%s)",
                     POISONED_EXIT_GRACE_S, EXIT_CUDA_POISONED, reason)
        self.stop(POISONED_EXIT_GRACE_S)

    async def serve(self, on_ready: Callable[[], None] | None = None,
                    install_signal_handlers: bool = False) -> None:
        self.bind()
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if install_signal_handlers:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(signum, self._stop.set)
        if self.debug_stall_s is not None:
            self._loop.add_signal_handler(signal.SIGUSR2, time.sleep, self.debug_stall_s)
        memory.use_mmap_for_large_buffers()  # big replies' memory goes back when freed
        self.service.counters.declare(
            [f"connections_closed_{reason}" for reason in CLOSE_REASONS]
            + ["connections_refused_cap", "connections_refused_no_fds",
               "accept_out_of_resources", "accept_errors", "frames_timed_out",
               "frames_refused_budget", "connections_reclaimed"])
        acceptor = Acceptor(self._sock, self.limits.connection_cap, lambda: self._num_open,
                            self._on_accept, self._count_event, reclaim=self._reclaim_idle)
        tasks = [asyncio.create_task(acceptor.run()), asyncio.create_task(self._sweep_leases()),
                 asyncio.create_task(self._watch.run(lambda: list(self._connections))),
                 asyncio.create_task(self.heartbeat.run())]
        try:
            self.service.stalls.install()  # every garbage collection timed while it serves
            if on_ready is not None:
                on_ready()
            await self._stop.wait()
        finally:
            self.heartbeat.stop()
            self.service.stalls.uninstall()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # the acceptor left the socket
            self._sock.close()
            await self._drop_all_connections()
            unlink_if_ours(self.socket_path, self._sock_identity)
            self.executor.shutdown(wait=True, cancel_futures=True)
            self.service.close()
            self._close_store()

    def _log_failure(self, what: str) -> None:
        """An unexpected exception being handled: its traceback, at most once per interval for
        each ``what`` and type of exception (one failing verb does not hide another failure)."""
        kind = f"{what}:{type(sys.exc_info()[1]).__name__}"
        self._log.event(kind, what, level=logging.ERROR, exc_info=True)

    def _count_event(self, name: str) -> None:
        self.service.counters.add(**{name: 1})

    def _close_store(self) -> None:
        store = self.service.store
        if self.flush_on_exit:
            # A graceful stop keeps DRAM-only blocks too: a restart from the same SSD dir has them.
            try:
                num_written = store.flush_to_ssd()
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
                self._log_failure("lease sweep failed")

    # ------------------------------------------------------------------------- connections

    def _reclaim_idle(self) -> bool:
        """At the connection cap: close the longest-idle connection that has been idle at
        least ``reclaim_idle_s`` and holds no lease or registration, for a new client to take
        its place; False if there is none. Closing it loses its client nothing but the socket
        (the idle timeout would close it too, later); engines hold registrations, so they stay.
        """
        now = time.monotonic()
        idle = [c for c in self._connections
                if c.closed_reason is None and c.is_idle()
                and now - c.last_activity >= self.limits.reclaim_idle_s]
        for conn in sorted(idle, key=lambda c: c.last_activity):
            if self.service.num_leases(conn.owner) or self.service.registry.of_owner(conn.owner):
                continue
            self._count_event("connections_reclaimed")
            self._log.event(
                "reclaimed", "at the cap of %d connections (--max-connections): closed the "
                "longest-idle one (%s, idle %.0f s, holding nothing) to take a new one",
                self.limits.connection_cap, conn.owner, now - conn.last_activity)
            conn.abort("reclaimed")
            return True
        return False

    def _on_accept(self, sock: socket.socket) -> None:
        self._num_open += 1
        task = asyncio.create_task(self._on_connect(sock))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def _on_connect(self, sock: socket.socket) -> None:
        sock = FdSocket.adopt(sock)  # the transport's reads take descriptors sent with frames
        try:
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=2**16)
        except OSError:
            sock.close()
            self._num_open -= 1
            return
        try:
            await self._serve_connection(reader, writer, sock)
        finally:
            sock.close_unclaimed()
            self._num_open -= 1

    async def _serve_connection(self, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter,
                                fd_socket: FdSocket | None = None) -> None:
        conn = Connection(next(self._conn_ids), reader, writer, self.max_inflight, fd_socket)
        sock = writer.get_extra_info("socket")
        uid = peer_uid(sock)
        if uid not in self.allowed_uids and not self.access.admits_group(sock):
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
            self.service.owner_leaving(conn.owner)  # its registrations go soon (drop_owner)
            if conn.held_large or conn.closed_reason is not None:
                self._watch.request_release()
            for ctx in conn.contexts:
                ctx.cancel()  # an engine that died needs no more copies
            await _reap(conn.tasks)
            # Leases and mappings go now; copies still running finish their current block first.
            await asyncio.get_running_loop().run_in_executor(
                None, self.service.drop_owner, conn.owner)
            conn.wire.close()  # its tasks' replies were claimed by the loop as they ended
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read_requests(self, reader: asyncio.StreamReader, conn: Connection) -> None:
        while True:
            try:
                header = await reader.readexactly(proto.HEADER_BYTES)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    await self._refuse(conn, None, proto.MALFORMED_FRAME, "truncated frame header")
                return
            received_at = time.monotonic()  # the deadline runs from here
            conn.last_activity = received_at
            try:
                length = proto.frame_length(header, self.max_frame_bytes)
            except proto.ProtocolError as exc:  # oversized: the body is never read
                await self._refuse(conn, None, exc.code, exc.message)
                return
            give_up_at = received_at + self.limits.frame_timeout_s
            room = None  # frames up to 64 KiB are requests, not payloads: never asked to wait
            if length <= _SMALL_FRAME_BYTES:
                conn.body_bytes += length
            else:  # counted as it arrives, not as announced
                conn.held_large = True
                room = BodyRoom(conn, lambda: self._watch.buffered_bytes(self._connections),
                                self.limits.max_buffered_bytes, self._watch.wait_for_room,
                                give_up_at, self._large_frames)
            try:
                try:
                    body = await read_body(reader, length, _INLINE_FRAME_BYTES, room, give_up_at)
                finally:  # read or not, it holds back no other frame from here on
                    if room is not None:
                        room.close()
            except asyncio.IncompleteReadError:
                return  # the peer went away mid-frame; nobody to answer
            except NoRoom:
                self._count_event("frames_refused_budget")
                await self._refuse(conn, None, proto.RESOURCE_EXHAUSTED,
                                   f"a {length}-byte frame does not fit the daemon's buffer "
                                   f"budget ({self.limits.max_buffered_bytes} bytes, "
                                   "--max-buffered-bytes) now")
                return
            except asyncio.TimeoutError:
                self._count_event("frames_timed_out")
                await self._refuse(conn, None, proto.RESOURCE_EXHAUSTED,
                                   f"a {length}-byte frame did not arrive within "
                                   f"{self.limits.frame_timeout_s:g} s")
                return
            try:
                fds = conn.claim_fds(length)
            except FdError as exc:  # every descriptor it sent is closed already
                await self._refuse(conn, None, exc.code, exc.message)
                return
            try:
                if length > _INLINE_FRAME_BYTES:  # a long chain's decode would stall everyone
                    decoded = await self._decode_off_loop(body, fds)
                else:
                    decoded = proto.decode_body(body, check_plain=False)
                request = proto.parse_request(decoded, self.default_deadline_ms)
                if fds and request.verb not in FD_VERBS:
                    raise proto.ProtocolError(
                        proto.BAD_REQUEST, f"file descriptors came with a {request.verb!r} "
                        f"request; only {sorted(FD_VERBS)} take them (closed)",
                        request.request_id)
            except proto.ProtocolError as exc:
                fds.close()
                conn.body_bytes -= length
                if exc.code == proto.MALFORMED_FRAME:
                    await self._refuse(conn, exc.request_id, exc.code, exc.message)
                    return
                self.service.count("invalid", exc.code)
                await conn.send(proto.error_reply(exc.request_id, exc.code, exc.message),
                                self.max_frame_bytes)
                continue
            del body
            try:
                await conn.slots.acquire()  # backpressure: stop reading at max in-flight
            except BaseException:
                fds.close()
                raise
            task = asyncio.create_task(self._answer(conn, request, received_at, length, fds))
            conn.tasks.add(task)
            task.add_done_callback(conn.tasks.discard)

    async def _decode_off_loop(self, body: bytes | memoryview, fds: FrameFds) -> Any:
        """``decode_body`` on a worker; the frame's descriptors are closed if the connection is
        cancelled meanwhile or the executor is gone (a ProtocolError leaves them to the caller,
        which closes them)."""
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.executor, partial(proto.decode_body, body, check_plain=False))
        except proto.ProtocolError:
            raise
        except BaseException:
            fds.close()
            raise

    async def _wait_for_reply_room(self, conn: Connection, received_at: float,
                                   deadline_ms: int) -> None:
        """A connection holding unread replies starts no bulk reply while the buffer budget is
        spent (until the watch cut someone off, or its deadline). One holding none goes on:
        a client that reads is never held back by those that do not."""
        give_up_at = received_at + deadline_ms / 1000.0
        while (conn.unread_bytes() > 0 and not conn.closing
               and self._watch.buffered_bytes(self._connections)
               >= self.limits.max_buffered_bytes):
            left_s = give_up_at - time.monotonic()
            if left_s <= 0:
                return  # the request answers deadline_exceeded
            await self._watch.wait_for_room(left_s)

    async def _refuse(self, conn: Connection, request_id: int | None, code: str,
                      message: str) -> None:
        self.service.count("invalid", code)
        await conn.send(proto.error_reply(request_id, code, message + "; closing the connection"),
                        self.max_frame_bytes)

    # ---------------------------------------------------------------------------- requests

    async def _answer(self, conn: Connection, request: proto.Request,
                      received_at: float, body_bytes: int, fds: FrameFds) -> None:
        """``fds``: the descriptors sent with the request (closed once its call is done)."""
        holds_bulk_slot = counted = handed_fds = False
        try:
            if request.verb in BULK_REPLY_VERBS:  # held until the value is written out
                await conn.bulk_slots.acquire()
                holds_bulk_slot = True
                await self._wait_for_reply_room(conn, received_at, request.deadline_ms)
            if conn.closing:  # cut off meanwhile: nobody will read the reply
                return
            deadline = request_start(request, received_at) + request.deadline_ms / 1000.0
            timeout_s = max(0.0, deadline - time.monotonic())
            on_loop = answered_on_loop(request.verb, body_bytes, self.inline_verbs)
            ctx = CallContext(owner=conn.owner, deadline=deadline, on_loop=on_loop,
                              fds=fds.numbers)
            conn.contexts.add(ctx)
            # a copy verb's worker writes its own reply (``direct_reply.py``)
            direct = None
            if request.verb in _COPY_VERBS and not on_loop:
                conn.wire.open_for_workers()
                direct = DirectReply(conn.wire, request.request_id, self.max_frame_bytes)
            try:
                handed_fds = True
                reply = await self._execute(request, ctx, timeout_s, fds, direct)
            except Exception as exc:  # never leave a client waiting on a reply
                self._log_failure(f"{request.verb} failed")
                reply = proto.error_reply(request.request_id, proto.INTERNAL, repr(exc))
            finally:
                conn.contexts.discard(ctx)
                conn.body_bytes -= body_bytes  # the request's bytes are consumed
                body_bytes = 0
            # The worker's reply stands if it claimed it first (an ok one: it claims only once
            # its call returned); else this one goes out, and the worker never writes.
            by_worker = direct is not None and not direct.claim()
            error = reply["error"]["code"] if not reply["ok"] and not by_worker else None
            sent_at = direct.sent_at if by_worker else None
            self.service.count(request.verb, error, (sent_at or time.monotonic()) - received_at)
            counted = True
            if by_worker:
                self._count_event("replies_by_worker" if sent_at is not None
                                  else "replies_by_worker_declined")
                if sent_at is not None:
                    conn.last_activity = time.monotonic()
                    return
                frame = direct.frame or encode_reply(reply, self.max_frame_bytes)
            else:
                frame = encode_reply(reply, self.max_frame_bytes)
            del reply  # a get's value: only the frame holds its bytes from here
            await conn.send_frame(frame)
        finally:
            if not handed_fds:
                fds.close()
            if not counted:  # its connection closed first (dropped, or cancelled mid-call)
                self.service.count(request.verb, _CLIENT_GONE)
            # Every way out gives the slots back, the early return of a connection cut off
            # included: a bulk slot kept would leave the connection's other gets waiting for
            # good (their tasks destroyed pending, one log error each, at the next collection).
            if holds_bulk_slot:
                conn.bulk_slots.release()
            conn.body_bytes -= body_bytes
            # Held until the reply is written out: a client that stops reading stalls only its
            # own connection (at max in-flight requests); the watch cuts it off.
            conn.slots.release()

    async def _execute(self, request: proto.Request, ctx: CallContext, timeout_s: float,
                       fds: FrameFds, direct: DirectReply | None = None) -> dict[str, Any]:
        """The call's reply; ``fds`` are closed once the call is done (a call past its
        deadline may still be mapping them on its worker). ``direct``: the worker writes the
        ok reply itself (the returned one is the same, to count), unless this gives up first."""
        rid = request.request_id
        call: WorkerCall | None = None
        try:
            if ctx.on_loop:
                result = self.service.call(request.verb, request.args, ctx)
                if not isinstance(result, Deferred):
                    return proto.ok_reply(rid, result)
                try:
                    call = WorkerCall(self.executor, result.run)
                except BaseException:  # shutting down: nobody will run it
                    result.abandon()
                    raise
            elif direct is not None:
                call = WorkerCall(self.executor, direct.run, self.service.call, request.verb,
                                  request.args, ctx)
            else:
                call = WorkerCall(self.executor, self.service.call, request.verb,
                                  request.args, ctx)
            try:
                result = await call.wait(timeout_s)
            except asyncio.CancelledError:  # the connection closed: its outcome is nobody's
                if direct is not None:
                    direct.claim()
                call.add_done_callback(self._cleanup_abandoned)
                raise
            except asyncio.TimeoutError:
                if direct is not None and not direct.claim():
                    # its worker answered as the deadline passed: that reply stands
                    return proto.ok_reply(rid, await call.wait())
                ctx.cancel()
                if request.verb in _COPY_VERBS:
                    # Not a byte may move after the engine hears "failed": wait for the copy to
                    # stop at its next block boundary (a lookup_load's lease nobody will use is
                    # released).
                    with contextlib.suppress(Exception):
                        self.service.release_abandoned(await call.wait())
                else:
                    call.add_done_callback(self._cleanup_abandoned)
                return proto.error_reply(rid, proto.DEADLINE_EXCEEDED,
                                         f"{request.verb} missed its {request.deadline_ms} ms "
                                         "deadline")
            return proto.ok_reply(rid, result)
        except ServiceError as exc:
            return proto.error_reply(rid, exc.code, exc.message)
        except RuntimeError as exc:
            if "shutdown" in str(exc):  # the executor is closing
                return proto.error_reply(rid, proto.SHUTTING_DOWN, "the daemon is shutting down")
            self._log_failure(f"{request.verb} failed")
            return proto.error_reply(rid, proto.INTERNAL, f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            self._log_failure(f"{request.verb} failed")
            return proto.error_reply(rid, proto.INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            if call is None or call.done():
                fds.close()
            else:  # closed on the loop, which counts the connection's descriptors
                loop = asyncio.get_running_loop()
                call.add_done_callback(lambda _: _soon(loop, fds.close))

    def _cleanup_abandoned(self, future: Future) -> None:
        """A call whose reply nobody reads: its exception retrieved (not logged as lost), the
        lease a late lookup took released."""
        if future.cancelled() or future.exception() is not None:
            return
        with contextlib.suppress(RuntimeError):  # shutting down: service.close() releases all
            self.executor.submit(self.service.release_abandoned, future.result())


def _soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    """``fn()`` on ``loop`` from any thread; at once if the loop is closed already."""
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:
        fn()


async def _reap(tasks: set[asyncio.Task]) -> None:
    """Cancel a closed connection's tasks and wait for them: none is left pending (to be
    destroyed with an error line each), none leaves an exception unretrieved."""
    waiting = list(tasks)
    for task in waiting:
        task.cancel()
    if waiting:
        await asyncio.gather(*waiting, return_exceptions=True)
