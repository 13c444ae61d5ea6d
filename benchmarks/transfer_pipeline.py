"""The daemon's save/load pipeline (``CopyPipeline``) in this process, with a time per phase.

Between the copier alone (one submission) and a request through the daemon (socket, msgpack,
executor thread) sits the pipeline itself: reserving slots or reading leased blocks, building a
chunk's runs, submitting chunks, waiting, publishing. This runs ``CopyPipeline.save`` and
``load`` against a ``TieredStore`` (pinned pool) in this process, on the caller's arena
through a ``PieceTable``, and sums the wall time spent in each phase: what the copy engine waits
for is whatever of it does not overlap the copies (``first_submit_ms``: request start to the
first chunk enqueued; ``tail_ms``: last chunk enqueued to the function's return).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import numpy as np


class _Phases:
    """Wraps callables and sums their wall time by name; remembers submission times."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self.submits: list[tuple[float, float]] = []

    def wrap(self, name: str, fn, submit: bool = False):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                self.ms[name] += (t1 - t0) * 1e3
                if submit:
                    self.submits.append((t0, t1))
        return timed


def pipeline_rows(arena_ptr: int, block_bytes: int, block_ids: list[int], reps: int) -> dict:
    """Median ms of an in-process save and load of ``block_ids`` (and per-phase ms)."""
    from kvstore.engines.copier import CudaCopier
    from kvstore.engines.copy_pipeline import CopyPipeline
    from kvstore.engines.run_arrays import PieceTable
    from kvstore.layout import KVLayout, Region
    from kvstore.store.tiered import StoreConfig, TieredStore

    n = len(block_ids)
    layout = KVLayout(max(block_ids) + 1, (Region(bytes(64), (max(block_ids) + 1) * block_bytes,
                                                  0, block_bytes, block_bytes),),
                      device="cuda:0", dtype="bfloat16")
    copier = CudaCopier(0)
    pipeline = CopyPipeline(copier, PieceTable(layout, [arena_ptr]))
    store = TieredStore(StoreConfig(dram_bytes=n * block_bytes + (64 << 20), pin_memory=True))
    namespace = b"pipeline" * 2
    out: dict[str, list[float]] = defaultdict(list)
    try:
        for rep in range(reps + 1):
            hashes = [os.urandom(16) for _ in range(n)]
            idents = [os.urandom(80) for _ in range(n)]
            for way in ("save", "load"):
                phases = _Phases()
                s = _Store(store, phases)
                # this pipeline's submissions timed (an instance attribute over the method)
                pipeline.copy_blocks = phases.wrap(  # type: ignore[method-assign]
                    "submit", CopyPipeline.copy_blocks.__get__(pipeline), submit=True)
                t0 = time.perf_counter()
                if way == "save":
                    outcomes = pipeline.save(s, namespace, block_ids, hashes, idents,
                                             lambda: False)
                    ok = outcomes.count("saved") == n
                else:
                    hit = store.lookup(namespace, hashes, idents)
                    ok = pipeline.load(s, hit.lease, block_ids, lambda: False) == n
                    store.release(hit.lease)
                t1 = time.perf_counter()
                if not ok:
                    raise RuntimeError(f"in-process {way} of {n} blocks fell short")
                if rep:
                    out[f"{way}_ms"].append((t1 - t0) * 1e3)
                    out[f"{way}_first_submit_ms"].append((phases.submits[0][1] - t0) * 1e3)
                    out[f"{way}_tail_ms"].append((t1 - phases.submits[-1][1]) * 1e3)
                    out[f"{way}_chunks"].append(len(phases.submits))
                    for name, ms in phases.ms.items():
                        out[f"{way}_{name}_ms"].append(ms)
            for h in hashes:
                store.remove(namespace, h)
    finally:
        store.close()
    return {f"pipeline_{k}": float(np.median(v)) for k, v in out.items()}


class _Store:
    """The store with the verbs a pipeline calls per block or per chunk timed."""

    def __init__(self, store, phases: _Phases) -> None:
        self.begin_write = phases.wrap("begin_write", store.begin_write)
        self.read = phases.wrap("read", store.read)
        self.read_addresses = phases.wrap("read", store.read_addresses)
        self.done = phases.wrap("done", store.done)
        self.done_range = phases.wrap("done", store.done_range)
        self.host_spans = store.host_spans  # the pipeline's bounds check (not timed: once a call)
