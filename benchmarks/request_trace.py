"""Where a daemon request's time goes between the socket and its copies: stage stamps per request.

Installed in a ``kvstore serve`` process by a benchmark's preamble (``import
benchmarks.request_trace as rt; rt.install(PATH)``, see ``bench_daemon``), it wraps the daemon's
request path and writes one JSON line per request: its verb and, in microseconds from the moment
the frame's header was read (``received``), when the request's task started (``answer``), when
the call was handed to a worker (``execute``), when the worker began and ended it (``call_in``,
``call_out``), when the copy pipeline began and ended (``pipe_in``, ``pipe_out``: saves and
loads), when the worker wrote a copy verb's reply itself (``replied``: the client can read it
from then; ``kvstore/daemon/direct_reply.py``), when the reply was counted (``counted``) and
when the loop wrote its frame or ended the request (``sent``).
Each line also carries ``at``, the ``received`` moment on the host's monotonic clock, so a
benchmark can cut the file into its phases (``summarize(..., window=(start, end))``, with the
client's ``time.monotonic()``: one clock per host). ``summarize`` turns the lines into median
gaps between consecutive stages, per verb (and p10/p90 with ``spread``).
A benchmark only: the daemon never imports it.
"""

from __future__ import annotations

import contextvars
import functools
import json
import statistics
import threading
import time
from pathlib import Path

from benchmarks.common import percentile

_record: contextvars.ContextVar[dict | None] = contextvars.ContextVar("request_trace",
                                                                       default=None)
_by_context: dict[int, dict] = {}  # id(CallContext) -> the request's record
_local = threading.local()
_lock = threading.Lock()

STAGES = ("received", "answer", "execute", "call_in", "pipe_in", "pipe_out", "call_out",
          "replied", "counted", "sent")


def _stamp(record: dict | None, name: str) -> None:
    if record is not None and name not in record:
        record[name] = time.monotonic()


def install(path: str) -> None:
    """Wrap the daemon's request path; one line per request is appended to ``path``."""
    from kvstore.daemon.connection import Connection
    from kvstore.daemon.direct_reply import DirectReply
    from kvstore.daemon.server import Daemon
    from kvstore.daemon.service import Service
    from kvstore.engines.copy_pipeline import CopyPipeline

    answer, execute, call = Daemon._answer, Daemon._execute, Service.call
    count, send, run = Service.count, Connection.send_frame, DirectReply.run

    @functools.wraps(answer)
    async def traced_answer(self, conn, request, received_at, *args, **kwargs):
        record = {"verb": request.verb, "received": received_at, "answer": time.monotonic()}
        _record.set(record)
        try:
            return await answer(self, conn, request, received_at, *args, **kwargs)
        finally:
            _stamp(record, "sent")
            _write(path, record)

    @functools.wraps(execute)
    async def traced_execute(self, request, ctx, *args, **kwargs):
        record = _record.get()
        _stamp(record, "execute")
        with _lock:
            _by_context[id(ctx)] = record
        try:
            return await execute(self, request, ctx, *args, **kwargs)
        finally:
            with _lock:
                _by_context.pop(id(ctx), None)

    @functools.wraps(call)
    def traced_call(self, verb, args, ctx):
        with _lock:
            record = _by_context.get(id(ctx))
        _stamp(record, "call_in")
        if record is not None:
            record["blocks"] = len(args.get("block_ids") or ())
        _local.record = record
        try:
            return call(self, verb, args, ctx)
        finally:
            _local.record = None
            _stamp(record, "call_out")

    def pipe(fn):
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            record = getattr(_local, "record", None)
            _stamp(record, "pipe_in")
            try:
                return fn(*args, **kwargs)
            finally:
                if record is not None:
                    record["pipe_out"] = time.monotonic()
        return traced

    @functools.wraps(run)
    def traced_run(self, fn, *args):
        try:
            return run(self, fn, *args)
        finally:
            if self.sent_at is not None:
                with _lock:
                    record = _by_context.get(id(args[-1]))  # (verb, args, ctx)
                if record is not None:
                    record.setdefault("replied", self.sent_at)

    @functools.wraps(count)
    def traced_count(self, *args, **kwargs):
        _stamp(_record.get(), "counted")
        return count(self, *args, **kwargs)

    @functools.wraps(send)
    async def traced_send(self, *args, **kwargs):
        try:
            return await send(self, *args, **kwargs)
        finally:
            _stamp(_record.get(), "sent")

    Daemon._answer, Daemon._execute, Service.call = traced_answer, traced_execute, traced_call
    Service.count, Connection.send_frame = traced_count, traced_send
    DirectReply.run = traced_run
    CopyPipeline.save, CopyPipeline.load = pipe(CopyPipeline.save), pipe(CopyPipeline.load)


def _write(path: str, record: dict) -> None:
    start = record["received"]
    row = {"verb": record["verb"], "blocks": record.get("blocks", 0), "at": start}
    row.update({k: round((v - start) * 1e6, 1) for k, v in record.items()
                if k in STAGES})
    with _lock, open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def summarize(path: Path, verbs: tuple[str, ...] = ("save", "load", "lookup_load"),
              window: tuple[float, float] | None = None, spread: bool = False) -> dict:
    """Per verb and number of blocks (``save 64``): the median µs between consecutive stages a
    request passed, and the count; ``window``: only requests received between these
    ``time.monotonic()`` moments; ``spread``: each gap as ``[p10, p50, p90]``."""
    rows: dict[str, list[dict]] = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if window is not None and not window[0] <= row.get("at", window[0]) <= window[1]:
            continue
        if row["verb"] in verbs:
            rows.setdefault(f"{row['verb']} {row['blocks']}", []).append(row)
    out = {}
    for verb, items in rows.items():
        gaps: dict[str, list[float]] = {}
        for row in items:
            seen = [s for s in STAGES if s in row]
            for a, b in zip(seen, seen[1:]):
                gaps.setdefault(f"{a}->{b}", []).append(row[b] - row[a])
        out[verb] = {"requests": len(items),
                     **{k: _spread(v) if spread else round(statistics.median(v), 1)
                        for k, v in gaps.items()}}
    return out


def _spread(values: list[float]) -> list[float]:
    """p10, p50, p90 of ``values``, rounded to 0.1 µs."""
    return [round(percentile(values, q), 1) for q in (0.1, 0.5, 0.9)]
