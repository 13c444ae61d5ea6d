"""Where a daemon's save or load spends its time: a timeline of every call, written as JSON lines.

Installed in a ``kvstore serve`` process by a benchmark's ``--trace`` preamble
(``import benchmarks.copy_trace as ct; ct.install(PATH)``), it wraps the daemon's GPU data
path (``CopyPipeline.save`` / ``load``, ``CudaCopier._submit`` /
``_submit_packed``) and records, per call: the wall time of each chunk's submission and timing
events on the copier's streams before and after it. When the call returns it writes one line:
wall ms of the call (and its entry and exit as epoch seconds, to set against the client's
send and reply), ms to the first submission and after the last, the copy streams' span on
the GPU and how long they sat idle between chunks (waiting for Python: reserving slots,
building runs), and the bytes moved.
A benchmark only: the daemon never imports it.
"""

from __future__ import annotations

import functools
import json
import queue
import threading
import time

_local = threading.local()
_lock = threading.Lock()
_pending: queue.Queue = queue.Queue()


def _summarize_pending() -> None:
    while True:
        path, way, t0, t1, chunks, enter_epoch, exit_epoch = _pending.get()
        row = _summary(way, t0, t1, chunks)
        row.update(enter_epoch=enter_epoch, exit_epoch=exit_epoch)
        _write(path, row)


def _wrap_call(fn, way: str, path: str):
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        _local.chunks = []
        enter_epoch = time.time()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            exit_epoch = time.time()
            chunks, _local.chunks = _local.chunks, None
            # summed up on another thread: its event waits must not delay this call's reply
            _pending.put((path, way, t0, t1, chunks, enter_epoch, exit_epoch))
    return traced


def _describe_runs(runs, kind, method) -> tuple[int, dict]:
    host = runs.dst_ptrs if kind == copier_kind_d2h() else runs.src_ptrs
    extents = 1 + int((host[:-1] + runs.num_bytes[:-1] != host[1:]).sum())
    return kind, {"bytes": runs.total_bytes, "runs": len(runs), "host_extents": extents,
                  "method": method}


def _describe_packed(table, regions, ids, host, kind) -> tuple[int, dict]:
    bb = table.block_bytes
    extents = 1 + int((host[:-1] + bb != host[1:]).sum())
    return kind, {"bytes": len(ids) * bb, "runs": len(ids) * table.num_pieces,
                  "host_extents": extents, "method": "packed"}


def _wrap_submit(submit, describe):
    @functools.wraps(submit)
    def traced(self, *args):
        chunks = getattr(_local, "chunks", None)
        if chunks is None:
            return submit(self, *args)
        import cupy as cp
        kind, row = describe(*args)
        streams = (self._streams[kind], self._side_streams[kind])
        before = []
        for s in streams:
            e = cp.cuda.Event()
            e.record(s)
            before.append(e)
        t_sub = time.perf_counter()
        handle = submit(self, *args)
        t_done = time.perf_counter()
        after = []
        for s in streams:
            e = cp.cuda.Event()
            e.record(s)
            after.append(e)
        chunks.append({"t_submit": t_sub, "t_submitted": t_done, **row, "before": before,
                       "after": after})
        return handle
    return traced


def copier_kind_d2h() -> int:
    from kvstore.engines import copier

    return copier._MEMCPY_DEVICE_TO_HOST


def _summary(way: str, t0: float, t1: float, chunks: list[dict]) -> dict:
    row = {"way": way, "wall_ms": (t1 - t0) * 1e3, "chunks": len(chunks),
           "bytes": sum(c["bytes"] for c in chunks)}
    if not chunks:
        return row
    for c in chunks:
        for e in c["after"]:
            e.synchronize()
    ref = chunks[0]["before"]
    import cupy as cp

    def ms(a, b) -> float:
        return cp.cuda.get_elapsed_time(a, b)

    # Per chunk on the GPU: started when both streams reached its first command, ended when
    # both passed its last (ms from the first chunk's start, per stream pair).
    spans = []
    for c in chunks:
        start = min(ms(r, b) for r, b in zip(ref, c["before"], strict=True))
        end = max(ms(r, a) for r, a in zip(ref, c["after"], strict=True))
        spans.append((start, end))
    idle, last_end = 0.0, spans[0][0]
    for start, end in spans:
        idle += max(0.0, start - last_end)
        last_end = max(last_end, end)
    row.update({
        "first_submit_ms": (chunks[0]["t_submit"] - t0) * 1e3,
        "after_last_submit_ms": (t1 - chunks[-1]["t_submitted"]) * 1e3,
        "python_submit_ms": sum(c["t_submitted"] - c["t_submit"] for c in chunks) * 1e3,
        "gpu_span_ms": last_end - spans[0][0],
        "gpu_idle_between_chunks_ms": idle,
        "methods": sorted({c["method"] for c in chunks}),
        "runs": sum(c["runs"] for c in chunks),
        "host_extents": sum(c["host_extents"] for c in chunks),
        "chunk_gpu_ms": [round(e - s, 3) for s, e in spans],
        "chunk_submit_ms": [round((c["t_submit"] - t0) * 1e3, 3) for c in chunks],
    })
    return row


def _write(path: str, row: dict) -> None:
    with _lock, open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _wrap_span(fn, name: str, path: str, is_async: bool):
    """Epoch seconds at entry and exit of a daemon method taking (request-ish, ...), per verb:
    ``Daemon._execute`` (the event loop has the request) and ``Service.call`` (a worker runs
    it)."""
    def row(verb: str, enter: float) -> None:
        if verb in ("save", "load"):
            _write(path, {"way": "span", "name": name, "verb": verb, "enter_epoch": enter,
                          "exit_epoch": time.time()})

    if is_async:
        @functools.wraps(fn)
        async def traced_async(self, request, *args, **kwargs):
            enter = time.time()
            try:
                return await fn(self, request, *args, **kwargs)
            finally:
                row(request.verb, enter)
        return traced_async

    @functools.wraps(fn)
    def traced(self, verb, *args, **kwargs):
        enter = time.time()
        try:
            return fn(self, verb, *args, **kwargs)
        finally:
            row(verb, enter)
    return traced


def install(path: str) -> None:
    """Trace every GPU save and load of this process into ``path`` (JSON lines, appended)."""
    from kvstore.daemon import server, service
    from kvstore.engines import copier
    from kvstore.engines.copy_pipeline import CopyPipeline

    threading.Thread(target=_summarize_pending, name="copy-trace", daemon=True).start()
    server.Daemon._execute = _wrap_span(server.Daemon._execute, "execute", path, True)
    service.Service.call = _wrap_span(service.Service.call, "call", path, False)
    CopyPipeline.save = _wrap_call(CopyPipeline.save, "save", path)
    CopyPipeline.load = _wrap_call(CopyPipeline.load, "load", path)
    copier.CudaCopier._submit = _wrap_submit(copier.CudaCopier._submit, _describe_runs)
    copier.CudaCopier._submit_packed = _wrap_submit(copier.CudaCopier._submit_packed,
                                                    _describe_packed)


def summarize(path: str) -> list[dict]:
    """Median figures per (way, bytes) of a trace file, for a benchmark's log."""
    import statistics

    groups: dict[tuple[str, int], list[dict]] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row["way"] == "span":
                continue
            groups.setdefault((row["way"], row["bytes"]), []).append(row)
    out = []
    keys = ("wall_ms", "first_submit_ms", "after_last_submit_ms", "python_submit_ms",
            "gpu_span_ms", "gpu_idle_between_chunks_ms", "chunks", "host_extents")
    for (way, nbytes), rows in sorted(groups.items()):
        summary = {"way": way, "bytes": nbytes, "calls": len(rows)}
        for k in keys:
            vals = [r[k] for r in rows if k in r]
            if vals:
                summary[k] = statistics.median(vals)
        out.append(summary)
    return out
