"""One ``cuMemcpyBatchAsync`` of shuffled 2.36 MB blocks, by its source order and flags and split
over streams, against one raw cudaMemcpy of the same bytes, in one run.

In this process, no daemon: a block-major arena (kvengine's layout, one 2.36 MB run per block) and
a cudaHostRegister'd ``HostPool`` (the daemon's pinned pool); shuffled block ids to shuffled pool
slots, both directions. Ways:

- ``stream``: one batch, source read in stream order (what the copier submits);
- ``any``: the driver may read the source out of stream order (``SRC_ACCESS_ORDER_ANY``);
- ``stream_overlap`` / ``any_overlap``: the same with ``PREFER_OVERLAP_WITH_COMPUTE``;
- ``any_2streams`` / ``any_4streams``: the blocks dealt round-robin to 2 / 4 streams of the same
  direction, a batch each, joined by events;
- ``stream_blocking``: ``stream`` with a blocking-sync event (``cudaEventBlockingSync``, what the
  copier records: the waiting thread sleeps instead of spinning);
- ``copier``: the daemon's ``CudaCopier`` submitting the same blocks (its own runs, method choice
  and blocking-sync event), waited on as the daemon waits.

Timed two ways, median of reps after a warm-up: device time by CUDA events around the
submission(s) (``gbps``) and wall clock from the call to the last event (``wall_gbps``, what a
request waits). Raw: CUDA events around one ``cudaMemcpyAsync`` of all the bytes.

    python -m benchmarks.batch_order [--blocks 64,256] [--reps 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import cuda_median_ms, finish

BLOCK_BYTES = 36 * 2 * 16 * 8 * 128 * 2
WAYS = ("stream", "any", "stream_overlap", "any_overlap", "any_2streams", "any_4streams",
        "stream_blocking")


def _rows(cp, cuda_batch, run_arrays, streams, copier, dev, host, to_device: bool, raw_ends,
          reps: int) -> list[dict]:
    """One direction of one batch size: raw, then every way of ``WAYS``."""
    n = len(dev)
    nbytes = n * BLOCK_BYTES
    sizes = np.full(n, BLOCK_BYTES, dtype=np.int64)
    runs = run_arrays(host, dev, sizes) if to_device else run_arrays(dev, host, sizes)
    kind, way_name = (1, "h2d") if to_device else (2, "d2h")
    raw = nbytes / cuda_median_ms(cp, lambda: cp.cuda.runtime.memcpyAsync(
        raw_ends[0], raw_ends[1], nbytes, kind, streams[0].ptr), reps, streams[0]) / 1e6
    rows = []
    for way in WAYS:
        order = cuda_batch.SRC_ACCESS_ORDER_ANY if way.startswith("any") else \
            cuda_batch.SRC_ACCESS_ORDER_STREAM
        flags = cuda_batch.FLAG_PREFER_OVERLAP_WITH_COMPUTE if "overlap" in way else 0
        parts = 2 if "2streams" in way else 4 if "4streams" in way else 1
        pieces = [run_arrays(runs.src_ptrs[i::parts], runs.dst_ptrs[i::parts],
                             runs.num_bytes[i::parts]) for i in range(parts)]

        def submit(pieces=pieces, order=order, flags=flags,
                   blocking="blocking" in way) -> list:
            events = []
            for piece, stream in zip(pieces, streams):
                cuda_batch.memcpy_batch(piece, stream.ptr, not to_device, to_device, 0,
                                        src_order=order, flags=flags, keep_gil=False)
                event = cp.cuda.Event(block=blocking, disable_timing=True)
                event.record(stream)
                events.append(event)
            return events

        def joined(submit=submit) -> None:  # every part's stream joins streams[0]
            for event in submit()[1:]:
                streams[0].wait_event(event)

        device_ms = cuda_median_ms(cp, joined, reps, streams[0])
        walls = []
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            for event in submit():
                event.synchronize()
            if rep:
                walls.append(time.perf_counter() - t0)
        gbps = nbytes / device_ms / 1e6
        wall_gbps = nbytes / float(np.median(walls)) / 1e9
        rows.append({"blocks": n, "way": way_name, "method": way, "gbps": gbps,
                     "wall_gbps": wall_gbps, "raw_gbps": raw, "vs_raw": gbps / raw,
                     "wall_vs_raw": wall_gbps / raw})
        print(f"{n:5d} blocks {way_name} {way:>15}: {gbps:5.1f} GB/s = {gbps / raw:.3f} "
              f"of raw {raw:.1f} (wall {wall_gbps / raw:.3f})", flush=True)
    walls = []
    submit = copier.host_to_device if to_device else copier.device_to_host
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        submit(runs).wait()
        if rep:
            walls.append(time.perf_counter() - t0)
    wall_gbps = nbytes / float(np.median(walls)) / 1e9
    rows.append({"blocks": n, "way": way_name, "method": "copier", "wall_gbps": wall_gbps,
                 "raw_gbps": raw, "wall_vs_raw": wall_gbps / raw})
    print(f"{n:5d} blocks {way_name} {'copier':>15}: wall {wall_gbps:5.1f} GB/s = "
          f"{wall_gbps / raw:.3f} of raw {raw:.1f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="64,256")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)

    import cupy as cp

    from kvstore.engines import cuda_batch
    from kvstore.engines.copier import CudaCopier
    from kvstore.engines.run_arrays import RunArrays
    from kvstore.store.dram.pool import HostPool

    if not cuda_batch.available():
        raise SystemExit("this driver has no cuMemcpyBatchAsync")
    counts = [int(x) for x in args.blocks.split(",")]
    num_blocks = max(counts) * 2
    arena = cp.empty(num_blocks * BLOCK_BYTES, dtype=cp.uint8)
    pool = HostPool(num_blocks * BLOCK_BYTES, pin=True)
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
    copier = CudaCopier(0)
    rng = np.random.default_rng(0)
    rows = []
    for n in counts:
        dev = arena.data.ptr + rng.permutation(num_blocks)[:n].astype(np.int64) * BLOCK_BYTES
        host = pool.base_address + rng.permutation(num_blocks)[:n].astype(np.int64) * BLOCK_BYTES
        for to_device in (False, True):
            sides = (pool.base_address, arena.data.ptr)
            raw_dst, raw_src = sides[::-1] if to_device else sides
            rows.extend(_rows(cp, cuda_batch, RunArrays, streams, copier, dev, host, to_device,
                              (raw_dst, raw_src), args.reps))
    pool.close()
    finish("batch_order", {"rows": rows,
                           "timing": "device: CUDA events around the submissions; wall: the call "
                                     "to the last event; medians of reps after a warm-up; raw: "
                                     "one cudaMemcpyAsync"}, args.out, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
