"""Builds cuDNN graphs in a child process while the engine serves (``CudnnPlans`` after the seal).

A cuDNN graph that the warm-up did not build costs 40 ms to 1.2 s to build, and the frontend
holds the GIL all that time, so a thread would stall the step loop as much as a build in line.
After ``/ready`` the engine runs our own attention kernel for a shape it has no graph for and
hands the shape to this builder: a child process with its own CUDA context and cuDNN handle
that builds the graph, serializes it, and sends the bytes back. The engine loads them (a few
ms) while no request waits for its step thread (``CudnnPlans.load_built``), else the next
step that meets the shape does; then cuDNN runs it.

The child starts on the first shape, exits after ``idle_s`` without work (its CUDA context is
given back), and again on the next shape. Every wait has a bound: a build past
``build_timeout_s`` kills the child and the shape is refused (our kernel keeps serving it); a
child that dies ``max_crashes`` times turns the builder off (the caller builds in line).
Frames both ways: ``kernels/plan_frames.py``.

Worker: ``python -m kernels.plan_builder --device N --target module:function``, the target
``function(key: tuple, device: int) -> bytes`` (``kernels.cudnn_build_target:serialized_plan``).
"""

from __future__ import annotations

import argparse
import enum
import importlib
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from kernels.plan_frames import decode_key, encode_frame, encode_key, read_frame, write_frame

log = logging.getLogger("kernels.plan_builder")

ENV = "KVSTORE_CUDNN_BUILDER"  # "off": build in line after ready (a request waits)
CUDNN_TARGET = "kernels.cudnn_build_target:serialized_plan"


class Outcome(str, enum.Enum):
    """What the builder counts (the ``outcome`` label of
    ``kvengine:cudnn_background_builds_total``)."""

    SUBMITTED = "submitted"
    BUILT = "built"
    REFUSED = "refused"
    TIMEOUTS = "timeouts"
    STARTS = "starts"
    CRASHES = "crashes"
    DROPPED = "dropped"
    QUEUE_FULL = "queue_full"


def wanted() -> bool:
    """False where ``KVSTORE_CUDNN_BUILDER`` is off."""
    return os.environ.get(ENV, "").strip().lower() not in ("off", "0", "no", "false")


@dataclass
class Built:
    """A graph the child built: its serialized bytes and the build's seconds there."""

    blob: bytes
    seconds: float


@dataclass
class Refused:
    """A shape the child could not build (cuDNN refused it, or the build ran out of time)."""

    reason: str


@dataclass
class _Child:
    process: subprocess.Popen
    pending: dict[str, float] = field(default_factory=dict)  # name -> when it was sent, in order
    busy_since: float = 0.0  # when the build now running began (the oldest pending one's)
    failure: str | None = None  # why the reader gave up on it


# -- the engine's side -------------------------------------------------------------------------

class PlanBuilder:
    """Sends shapes to the child and keeps what comes back until the caller takes it.
    ``submit`` and ``take`` are called from one thread (the engine's step); a reader thread
    only moves the child's answers into ``_results``."""

    def __init__(self, device: int, target: str = CUDNN_TARGET, idle_s: float = 30.0,
                 build_timeout_s: float = 120.0, max_pending: int = 64, max_crashes: int = 3,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.device, self.target = int(device), target
        self.idle_s, self.build_timeout_s = float(idle_s), float(build_timeout_s)
        self.max_pending, self.max_crashes = int(max_pending), int(max_crashes)
        self._clock = clock
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self._results: dict[str, Built | Refused] = {}
        self.counts: Counter[Outcome] = Counter({outcome: 0 for outcome in Outcome})
        self.enabled = True

    def knows(self, name: str) -> bool:
        """Whether ``name`` is being built or its result waits to be taken."""
        with self._lock:
            return name in self._results or (self._child is not None
                                              and name in self._child.pending)

    def submit(self, name: str, key: tuple) -> bool:
        """Queue ``key``'s build and answer True: the caller's kernel serves the shape
        meanwhile (with a full queue it is not queued, and is sent when it comes again). False
        when the builder is off: the caller builds in line."""
        if not self.enabled:
            return False
        self._check_timeouts()
        with self._lock:
            child = self._child
            if child is not None and name in child.pending:
                return True
            if child is not None and len(child.pending) >= self.max_pending:
                self.counts[Outcome.QUEUE_FULL] += 1
                return True
        try:
            frame = encode_frame({"name": name, "key": encode_key(key)})
        except (TypeError, ValueError) as exc:  # a key part JSON cannot carry: build in line
            log.error("cuDNN plan builder: cannot send key %r (%s)", key, exc)
            return False
        for _ in range(2):  # a child that has just left for idleness is started again once
            child = self._running_child()
            if child is None:
                return False
            try:
                with self._lock:  # pending before the frame leaves: its answer may come at once
                    if not child.pending:
                        child.busy_since = self._clock()
                    child.pending[name] = self._clock()
                child.process.stdin.write(frame)
                child.process.stdin.flush()
            except (OSError, ValueError):  # the child is gone (a broken pipe)
                with self._lock:
                    child.pending.pop(name, None)
                self._reap(child)
                continue
            self.counts[Outcome.SUBMITTED] += 1
            return True
        return False

    def finished(self) -> list[str]:
        """The names whose result is in and not taken yet, oldest first."""
        with self._lock:
            return list(self._results)

    def take(self, name: str) -> Built | Refused | None:
        """``name``'s result once (None while it is still being built, or was dropped)."""
        self._check_timeouts()
        with self._lock:
            return self._results.pop(name, None)

    def close(self) -> None:
        """Stops the child; the builder stays off (``submit`` answers False)."""
        self.enabled = False
        with self._lock:
            child, self._child = self._child, None
        if child is not None:
            _stop(child.process)

    # -- the child ---------------------------------------------------------------------------

    def _running_child(self) -> _Child | None:
        with self._lock:
            child = self._child
        if child is not None and child.process.poll() is None:
            return child
        if child is not None:
            self._reap(child)
        if not self.enabled:
            return None
        command = [sys.executable, "-m", "kernels.plan_builder", "--device", str(self.device),
                   "--target", self.target, "--idle-s", str(self.idle_s)]
        try:
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       cwd=_package_root(), env=_child_env())
        except OSError as exc:
            self._crashed(f"cannot start: {exc}")
            return None
        child = _Child(process)
        with self._lock:
            self._child = child
        self.counts[Outcome.STARTS] += 1
        threading.Thread(target=self._read, args=(child,), daemon=True,
                         name="cudnn-plan-builder").start()
        return child

    def _read(self, child: _Child) -> None:
        """Moves the child's answers into ``_results`` until its stdout ends."""
        try:
            while (frame := read_frame(child.process.stdout)) is not None:
                header, blob = frame
                name = str(header.get("name"))
                outcome = Built(blob, float(header.get("seconds") or 0.0)) \
                    if header.get("ok") is True else Refused(str(header.get("error", "refused")))
                with self._lock:
                    if child.pending.pop(name, None) is None:
                        continue  # timed out or dropped meanwhile
                    child.busy_since = self._clock()  # the next pending one starts now
                    self._results[name] = outcome
                    self.counts[Outcome.BUILT if isinstance(outcome, Built)
                                else Outcome.REFUSED] += 1
        except Exception as exc:  # a malformed answer: this child is not trusted any more
            child.failure = f"sent an unreadable answer ({type(exc).__name__}: {exc})"
            child.process.kill()
        self._reap(child)

    def _reap(self, child: _Child) -> None:
        """The child is gone. After an idle exit, what it still owed is dropped (sent again
        when it comes back); after a crash, the shape it was building is refused (sending it
        again would crash the next child) and the rest dropped. Counted once per child."""
        code = _stop(child.process)
        with self._lock:
            if self._child is not child:
                return  # reaped already, or stopped on purpose (a timeout, close)
            self._child = None
            crashed = child.failure is not None or code != 0
            why = child.failure or f"exited with {code}"
            names = list(child.pending)
            child.pending.clear()
            if crashed and names:
                self._results[names[0]] = Refused(f"the builder process died building it: {why}")
                self.counts[Outcome.REFUSED] += 1
                names = names[1:]
            self.counts[Outcome.DROPPED] += len(names)
        if crashed:
            self._crashed(why)

    def _crashed(self, why: str) -> None:
        self.counts[Outcome.CRASHES] += 1
        if self.counts[Outcome.CRASHES] >= self.max_crashes and self.enabled:
            self.enabled = False
            log.error("cuDNN plan builder %s, %d times: off; graphs are built in line again "
                      "(a request waits for each)", why, self.counts[Outcome.CRASHES])
        else:
            log.warning("cuDNN plan builder %s", why)

    def _check_timeouts(self) -> None:
        """A build running past ``build_timeout_s``: its shape is refused (our kernel keeps
        it), the child killed at once, and the shapes queued behind it dropped (sent again)."""
        with self._lock:
            child = self._child
            if child is None or not child.pending or \
                    self._clock() - child.busy_since <= self.build_timeout_s:
                return
            names = list(child.pending)
            self._results[names[0]] = Refused(f"the build ran past {self.build_timeout_s:g} s")
            self.counts[Outcome.TIMEOUTS] += 1
            self.counts[Outcome.DROPPED] += len(names) - 1
            child.pending.clear()
            self._child = None
        log.warning("cuDNN plan builder: a build ran past %g s; the child is killed and that "
                    "shape stays on our kernel", self.build_timeout_s)
        child.process.kill()  # never a wait here: this is the engine's step thread


def _stop(process: subprocess.Popen) -> int | None:
    """Ends ``process`` (closing its input first, then a signal) and returns its exit code."""
    if process.poll() is None:
        try:
            if process.stdin is not None:
                process.stdin.close()
        except OSError:
            pass
        try:
            return process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                return process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                process.kill()
                return process.wait()
    return process.returncode


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = _package_root()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


# -- the child's side --------------------------------------------------------------------------

def serve(target: Callable[[tuple, int], bytes], device: int, idle_s: float,
          stdin: IO[bytes], stdout: IO[bytes]) -> int:
    """Builds each shape read from ``stdin`` and answers on ``stdout``; returns 0 at the end
    of the input or after ``idle_s`` without a frame."""
    while True:
        ready, _, _ = select.select([stdin], [], [], idle_s)
        if not ready:
            return 0
        frame = read_frame(stdin)
        if frame is None:
            return 0
        header, _ = frame
        name = str(header.get("name"))
        start = time.perf_counter()
        try:
            blob = target(decode_key(header.get("key")), device)
        except Exception as exc:  # cuDNN refuses this shape: the engine's kernel serves it
            answer, blob = {"name": name, "ok": False,
                            "error": f"{type(exc).__name__}: {exc}"}, b""
        else:
            answer = {"name": name, "ok": True,
                      "seconds": round(time.perf_counter() - start, 4)}
        try:
            write_frame(stdout, answer, bytes(blob))
        except BrokenPipeError:  # the engine is gone: nobody waits for this graph
            return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.plan_builder")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--target", default=CUDNN_TARGET)
    parser.add_argument("--idle-s", type=float, default=30.0)
    args = parser.parse_args(argv)
    frames = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever a library prints (its import too) goes to stderr, not the frames
    module, _, function = args.target.partition(":")
    target = getattr(importlib.import_module(module), function)
    # unbuffered input: ``select`` must see every byte that has not been read yet
    return serve(target, args.device, args.idle_s, sys.stdin.buffer.raw, frames)


if __name__ == "__main__":
    sys.exit(main())
