"""Shared bits of the daemon tests: a real `kvstore serve` subprocess, raw frames, shm layouts."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvstore.keys import Namespace, block_hashes, block_ident
from kvstore.testing.processes import stop_process
from kvstore.wire import protocol as proto
from kvstore.wire.client import Client
from kvstore.wire.fds import send_with_fds

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 30.0


@dataclass
class RunningDaemon:
    proc: subprocess.Popen
    socket_path: Path
    http_url: str | None
    ssd_dir: Path | None
    lines: list[str] = field(default_factory=list)

    def client(self, **kwargs) -> Client:
        return Client(self.socket_path, **kwargs)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        returncode = stop_process(self.proc, sig, timeout_s)
        shutil.rmtree(self.socket_path.parent, ignore_errors=True)
        return returncode

    def kill9(self) -> None:
        self.stop(signal.SIGKILL)


def _pump(stream, lines: list[str], out: queue.Queue) -> None:
    for line in stream:
        lines.append(line.rstrip("\n"))
        out.put(line)
    out.put(None)


# ``start_daemon(protocol=...)``: the daemon's hello names another (older) protocol version.
_CLAIMING_SERVE = ("import sys; import kvstore.wire.protocol as p; p.PROTOCOL_VERSION = {!r}; "
                   "from kvstore.cli import main; sys.exit(main(sys.argv[1:]))")


def start_daemon(workdir: Path, *extra: str, dram: str = "32MiB", ssd_dir: Path | None = None,
                 ssd_size: str | None = None, http: bool = True,
                 env: dict[str, str] | None = None,
                 socket_path: Path | None = None,
                 start_timeout_s: float = START_TIMEOUT_S,
                 protocol: str | None = None) -> RunningDaemon:
    """Start `python -m kvstore.cli serve` (on a fresh socket unless given); wait until ready.
    ``protocol``: the version the daemon says in its hello, as an older daemon would (its
    verbs stay this tree's: what a client may ask is the client's choice)."""
    # A short private directory: sun_path holds only 107 bytes, pytest's tmp paths can be long.
    if socket_path is None:
        socket_path = Path(tempfile.mkdtemp(prefix="kvs-")) / "kvstore.sock"
    head = [sys.executable, "-m", "kvstore.cli"]
    if protocol is not None:
        head = [sys.executable, "-c", _CLAIMING_SERVE.format(protocol)]
    args = [*head, "serve", "--socket", str(socket_path),
            "--dram", dram, "--http", "127.0.0.1:0" if http else "off", *extra]
    if ssd_dir is not None:
        args += ["--ssd-dir", str(ssd_dir), "--ssd-size", ssd_size or "64MiB"]
    full_env = {**os.environ, **(env or {})}
    full_env.pop("KVSTORE_SOCKET", None)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO_ROOT, env=full_env)
    lines: list[str] = []
    ready: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines, ready), daemon=True).start()
    deadline = time.monotonic() + start_timeout_s
    http_url = None
    while True:
        try:
            line = ready.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            raise RuntimeError("daemon did not get ready:\n" + "\n".join(lines)) from None
        if line is None:
            raise RuntimeError(f"daemon exited with {proc.wait()}:\n" + "\n".join(lines))
        if "admin HTTP http" in line:
            http_url = line.rsplit(" ", 1)[-1].strip()
        if "kvstore: ready" in line:
            break
    daemon = RunningDaemon(proc, socket_path, http_url, ssd_dir, lines)
    wait_healthy(daemon)
    return daemon


@contextmanager
def daemon_factory(workdir: Path, **defaults) -> Iterator[Callable[..., RunningDaemon]]:
    """``make(*flags, **kwargs)`` starts a dedicated daemon (``start_daemon``, ``defaults``
    under ``kwargs``); every one started is stopped on exit. The conftests' ``make_daemon``."""
    started: list[RunningDaemon] = []

    def make(*extra: str, **kwargs) -> RunningDaemon:
        running = start_daemon(workdir, *extra, **{**defaults, **kwargs})
        started.append(running)
        return running

    try:
        yield make
    finally:
        for running in started:
            running.stop()


def wait_healthy(daemon: RunningDaemon, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with daemon.client(timeout_s=2.0) as c:
                if c.health()["status"] == "ok":
                    return
        except ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until true or the deadline; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


# ------------------------------------------------------------------------------- raw frames


def raw_connect(path: Path, timeout_s: float = 10.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.connect(str(path))
    return sock


def send_message(sock: socket.socket, obj, fds: tuple[int, ...] = ()) -> None:
    """One frame of ``obj``, with ``fds`` (SCM_RIGHTS) as the client sends a register's."""
    send_with_fds(sock, [b"".join(proto.encode_frame(obj))], fds)


def recv_message(sock: socket.socket):
    """The next frame's message, or None if the daemon closed the connection."""
    header = _recv_exactly(sock, proto.HEADER_BYTES)
    if header is None:
        return None
    body = _recv_exactly(sock, proto.frame_length(header))
    return None if body is None else proto.decode_body(body)


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def is_closed(sock: socket.socket, timeout_s: float = 5.0) -> bool:
    """True if the peer closed (EOF, reset or another socket error after what it sent) within
    the timeout; ``timeout_s=0``: by now, without waiting. What it sent is read and dropped."""
    sock.settimeout(timeout_s)
    try:
        while True:
            data = sock.recv(1 << 20)
            if not data:
                return True
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:
        return True


# ----------------------------------------------------------------------------- block chains


@dataclass
class Chain:
    """A namespace and a chain of full blocks: hashes and idents as the engine computes them."""

    namespace: bytes
    hashes: list[bytes]
    idents: list[bytes]


def make_chain(name: str, num_blocks: int, block_size: int = 16, seed: int = 0) -> Chain:
    namespace = Namespace(name=name).digest
    tokens = np.random.default_rng(seed).integers(0, 50_000, num_blocks * block_size)
    hashes = block_hashes(namespace, tokens, block_size)
    parents = [namespace, *hashes[:-1]]
    idents = [block_ident(parents[i], tokens[i * block_size:(i + 1) * block_size])
              for i in range(num_blocks)]
    return Chain(namespace, hashes, idents)


def random_bytes(num_bytes: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8).tobytes()
