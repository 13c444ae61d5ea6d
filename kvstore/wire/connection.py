"""Connection: one socket to the daemon, many requests in flight, thread-safe.

A request's frame goes out under a send lock (``request``; ``request_nowait`` for a caller that
must never block); a reader thread dispatches the replies by request id to their ``Pending``
handles. The first request is preceded by the hello (protocol versions); a daemon that refused
the connection wrote why before it closed, and that is the error every waiter gets.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvstore.settings import default_socket_path
from kvstore.wire import protocol as proto
from kvstore.wire.fds import send_with_fds
from kvstore.wire.handshake import hello_args, key_filter_info, read_hello, same_clock
from kvstore.wire.peer_process import PeerProcess
from kvstore.wire.pending_table import PendingTable
from kvstore.wire.replies import ClientError, DaemonUnavailable, Pending, error_of

# How long a failed send waits for the reader to find the daemon's refusal frame (it is in the
# socket already when the daemon closed after writing it).
_REFUSAL_WAIT_S = 1.0


class Connection:
    """A connection to ``kvstore serve``: requests out, replies dispatched by id to their
    ``Pending``; usable from many threads at once. ``Client`` adds the verbs."""

    def __init__(self, socket_path: str | Path | None = None, timeout_s: float = 30.0,
                 max_frame_bytes: int = proto.MAX_FRAME_BYTES) -> None:
        self.socket_path = Path(socket_path) if socket_path is not None else default_socket_path()
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self._ids = itertools.count(1)
        # Two locks: the reader thread takes only the table's, never _send_lock, so replies
        # keep draining while a large request is being written (else both sides could block).
        self._in_flight = PendingTable()
        self._send_lock = threading.Lock()  # one frame at a time on the socket
        # The daemon's error frame that refused this connection (its connection cap, a uid it
        # does not serve), set by the reader thread: the reason it closed, whatever comes next.
        self._refusal: ClientError | None = None
        # The hello (protocol versions) goes out in front of the first request, unanswered by
        # nobody: its reply is checked by the reader thread.
        self._hello_id: int | None = None
        self.daemon_protocol: str | None = None  # once the hello is answered
        # The daemon reads our CLOCK_MONOTONIC (its hello answer fell between our send and our
        # read of it): each request then says when it was sent (see proto.Request.sent_mono).
        self.clock_shared = False
        # The daemon's key filter (1.5): {"path", "authoritative", "nonce"} from the hello.
        self.key_filter_info: dict | None = None
        self._hello_sent_at = 0.0
        self.last_reply_at = time.monotonic()  # when the reader last got a frame (any reply)
        self._sock = self._connect()
        # The daemon's process, watched from before the first request (``PeerProcess``).
        self.daemon_process = PeerProcess.of_socket(self._sock)
        self._reader = threading.Thread(target=self._read_loop, name="kvstore-client-reader",
                                        daemon=True)
        self._reader.start()

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(min(self.timeout_s, 10.0))
        try:
            sock.connect(os.fspath(self.socket_path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise DaemonUnavailable(f"kvstore daemon not reachable at {self.socket_path} "
                                    f"({exc.strerror}); is `kvstore serve` running?") from None
        except OSError as exc:
            sock.close()
            raise DaemonUnavailable(f"cannot connect to kvstore daemon at {self.socket_path}: "
                                    f"{exc.strerror or exc}") from None
        sock.settimeout(None)
        return sock

    # ----------------------------------------------------------------------------- plumbing

    def request(self, verb: str, args: dict[str, Any] | None = None,
                timeout_s: float | None = None,
                convert: Callable[[Any], Any] | None = None,
                fds: Sequence[int] = ()) -> Pending:
        """Send a request without waiting; the daemon enforces ``timeout_s`` as its deadline.
        ``fds`` go with the frame (SCM_RIGHTS, only for ``register``; they stay the caller's)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self._hello_id is None and verb != "hello":
            self._hello_id = -1  # taken: the hello itself goes through here once
            self.request("hello", hello_args(), timeout_s)
        request_id = next(self._ids)
        if verb == "hello" and self._hello_id == -1:
            self._hello_id = request_id  # before it is sent: its reply may come at once
            self._hello_sent_at = time.monotonic()
        frame, pending = self._prepare(request_id, verb, args, timeout_s, convert)
        try:
            with self._send_lock:
                send_with_fds(self._sock, frame, fds)
        except OSError as exc:
            raise self._broken(exc) from None
        return pending

    def _prepare(self, request_id: int, verb: str, args: dict[str, Any] | None,
                 timeout_s: float, convert: Callable[[Any], Any] | None
                 ) -> tuple[list[bytes], Pending]:
        """A request's frame, and its ``Pending`` already waiting for the reply."""
        deadline_ms = max(1, min(int(timeout_s * 1000), proto.MAX_DEADLINE_MS))
        envelope = {"id": request_id, "verb": verb, "deadline_ms": deadline_ms,
                    "args": args or {}}
        if self.clock_shared:
            envelope["sent_mono"] = time.monotonic()
        frame = proto.encode_frame(envelope, self.max_frame_bytes)
        pending = Pending(self._in_flight.forget, request_id, verb, timeout_s, convert)
        self._in_flight.add(pending)
        return frame, pending

    def request_nowait(self, verb: str, args: dict[str, Any] | None,
                       timeout_s: float | None, convert: Callable[[Any], Any] | None,
                       finish: Callable[[Callable[[], None]], Any]) -> Pending | None:
        """``request`` for a caller that must never block (an event loop): the frame goes out
        only as far as the socket takes it at once; the rest of a frame it took in part is
        handed to ``finish`` (which runs it on another thread, where it may block). None when
        nothing was sent (another send is under way, the socket is full, or the hello is not
        out yet): send it with ``request`` from a thread instead."""
        if self._hello_id is None or not self._send_lock.acquire(blocking=False):
            return None
        handed_on = False
        try:
            timeout_s = self.timeout_s if timeout_s is None else timeout_s
            request_id = next(self._ids)
            frame, pending = self._prepare(request_id, verb, args, timeout_s, convert)
            try:
                sent = self._sock.sendmsg(list(frame), [], socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                raise self._broken(exc, wait_for_refusal=False) from None
            if sent == 0:
                self._in_flight.forget(request_id)
                return None
            total = sum(len(part) for part in frame)
            if sent < total:
                rest = memoryview(b"".join(frame))[sent:]

                def complete() -> None:
                    try:
                        self._sock.sendall(rest)
                    except OSError as exc:
                        self._broken(exc, wait_for_refusal=False)
                    finally:
                        self._send_lock.release()

                finish(complete)
                handed_on = True
            return pending
        finally:
            if not handed_on:
                self._send_lock.release()

    def _broken(self, exc: OSError, wait_for_refusal: bool = True) -> BaseException:
        """A send failed: a frame may be half written, so the stream is unusable from here on.
        Every request in flight fails with the error returned: a daemon that refused the
        connection wrote why before it closed, and that is said, not "Broken pipe" (waiting a
        moment for the reader to see it, unless the caller must not wait)."""
        error: BaseException = DaemonUnavailable(
            f"kvstore daemon at {self.socket_path} closed the connection ({exc})")
        error = self._refusal_or(error) if wait_for_refusal else (self._refusal or error)
        self._in_flight.fail_all(error)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        return error

    def call(self, verb: str, args: dict[str, Any] | None = None,
             timeout_s: float | None = None) -> Any:
        """Send a request and wait for its result."""
        return self.request(verb, args, timeout_s).wait()

    def _recv_exactly(self, num_bytes: int) -> bytearray | None:
        buf = bytearray(num_bytes)
        view = memoryview(buf)
        got = 0
        while got < num_bytes:
            n = self._sock.recv_into(view[got:])
            if n == 0:
                return None
            got += n
        return buf

    def _read_loop(self) -> None:
        error: BaseException = DaemonUnavailable(
            f"kvstore daemon at {self.socket_path} closed the connection")
        try:
            while True:
                header = self._recv_exactly(proto.HEADER_BYTES)
                if header is None:
                    break
                body = self._recv_exactly(proto.frame_length(bytes(header),
                                                             self.max_frame_bytes))
                if body is None:
                    break
                self.last_reply_at = time.monotonic()  # the daemon answers: slow, not stopped
                reply = proto.decode_body(body)
                if not isinstance(reply, dict):
                    raise proto.ProtocolError("bad_reply", "reply is not a map")
                self._dispatch(reply)
                if reply.get("id") is None and not reply.get("ok"):
                    # A connection-level refusal (permission, malformed frame): it closes next.
                    error = self._refusal = error_of(reply)
        except proto.ProtocolError as exc:
            error = DaemonUnavailable(f"unreadable reply from the daemon: {exc.message}")
        except OSError as exc:
            # A daemon that closes with our request unread resets the connection after its
            # refusal frame: the refusal is the reason.
            if self._in_flight.closed_error is None and self._refusal is None:
                error = DaemonUnavailable(f"connection to kvstore daemon lost: {exc}")
        self._in_flight.fail_all(error)

    def _refusal_or(self, error: DaemonUnavailable) -> BaseException:
        """After a failed send: the daemon's refusal if it sent one (the reader thread reads it
        on its way to the end of the stream, which the daemon closed), else ``error``."""
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=_REFUSAL_WAIT_S)
        return self._refusal or error

    def _dispatch(self, reply: dict) -> None:
        if reply.get("id") == self._hello_id is not None:
            self._check_hello(reply)
        self._in_flight.finish(reply)

    def knows_verb(self, verb: str) -> bool:
        """Whether the daemon's protocol (from the hello's answer) has ``verb``; False while
        that answer has not come for a verb a later minor added."""
        return proto.knows_verb(self.daemon_protocol, verb)

    def _check_hello(self, reply: dict) -> None:
        """The hello's answer: another major fails every request with one error naming both."""
        self.daemon_protocol, mismatch = read_hello(reply, self.socket_path)
        self.clock_shared = same_clock(reply, self._hello_sent_at, time.monotonic())
        self.key_filter_info = key_filter_info(reply)
        if mismatch is not None:
            # the connection's refusal: a request whose send then fails on the closed socket
            # reports it, not "Broken pipe" (``_broken``)
            self._refusal = mismatch
            self._in_flight.fail_all(mismatch)
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    def answer_waiting(self) -> bool:
        """Bytes from the daemon wait in the socket, not yet read: it is answering, whatever
        the reader thread's last read says (held up in this process, behind the GIL or a
        collection, it has not got to them). Peeks; never blocks, never consumes."""
        try:
            return bool(self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:  # nothing there (EAGAIN), or closed: the reader says which
            return False

    @property
    def is_closed(self) -> bool:
        """True once the connection is gone (closed here, or the daemon went away)."""
        return self._in_flight.closed_error is not None

    def close(self) -> None:
        """Close the connection; requests still in flight fail with DaemonUnavailable."""
        self._in_flight.close(DaemonUnavailable("client closed"))
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout=5.0)
        self._sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
