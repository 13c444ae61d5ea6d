"""Save/load bandwidth through the daemon against raw pinned cudaMemcpy of the same bytes, one run.

The engine side is this process: a 1,024-block Qwen3-4B arena (2.36 MB blocks) in its own
cudaMalloc, registered with a real `kvstore serve` subprocess by CUDA IPC handle. For 64/256/1,024
block ids (shuffled, and consecutive) it times by wall clock around the client calls:
``single``: one `Client.save` (fresh hashes every rep), then one `Client.load` after a lookup (the
lookup is timed apart); ``streamed``: ``--depth`` such requests in flight at once (shuffled ids), as
an engine that keeps saving does, so one request's round trip hides behind another's copies. By
CUDA events: one raw cudaMemcpyAsync of the same bytes between the arena and cudaHostAlloc'd memory
and between the arena and a cudaHostRegister'd HostPool (the daemon's kind of pinned memory).
Ratios are daemon over raw cudaHostAlloc bandwidth. Also in this process: the copier alone
(shuffled blocks into consecutive pool slots, one submission) and the daemon's save/load pipeline
without the daemon (``transfer_pipeline``: a ``TieredStore`` here, time per phase).
Daemon variants, each a daemon started with other ``kvstore serve --copy-*`` options:
``default`` (as shipped: pipelined chunks), ``one_submission`` (each request one batch: reserve all,
one copy submission, wait, publish), ``load_save_ramp`` (loads chunked as saves are: 2, 4, 8 ...
blocks up to 32 MiB, as before s28), ``memcpy_large`` / ``kernel_large`` (block-major runs by a
``cudaMemcpyAsync`` each / one ``copy_runs`` launch per chunk, instead of the default's one
``cuMemcpyBatchAsync``), ``staged_large`` / ``packed_large`` (gathered on the GPU into a staging
slot that crosses the bus in as few runs as the pool slots allow: by ``copy_runs`` / by
``copy_pieces``), ``staged_loads`` (only loads staged: a bus copy per contiguous stretch of pool
slots, then a scatter kernel; saves stay on the copy engines), ``batch_keeps_gil`` (the batch call
holds the interpreter's lock instead of letting go of it), ``chunk_16m`` / ``chunk_64m`` /
``chunk_128m`` (a save's pipelined chunks of at most that many bytes instead of 32 MiB: fewer
submissions against a later first copy), ``wait_polled`` (copies waited for by polling their events,
``--copy-wait-poll-us 20``).
``--trace``: a timeline of every daemon save and load (``copy_trace``); ``--request-trace``: each
request's stages from socket to reply (``request_trace``): p10/p50/p90 gaps per row, of that
row's own requests (kept in its JSON row). Per variant also the round trip of a request that
moves nothing (``health``): the floor under every save/load.

    python -m benchmarks.transfer_daemon [--blocks 64,256,1024] [--reps 10] [--depth 4]
                                         [--variants default,one_submission] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_daemon import start_daemon, stop_daemon
from benchmarks.common import cuda_median_ms, finish, names_arg
from benchmarks.transfer_pipeline import pipeline_rows

BLOCK_BYTES = 36 * 2 * 16 * 8 * 128 * 2
IDENT_BYTES = 16 + 16 * 4  # parent hash + 16 int32 token ids, as the engine sends them
# Daemon variants: the `kvstore serve` options each starts its daemon with ([] = as shipped).
_VARIANTS = {"default": [],
             "one_submission": ["--copy-chunk-size", "0", "--copy-load-chunk-size", "0"],
             # loads chunked as saves are (2, 4, 8 ... blocks up to 32 MiB): before s28
             "load_save_ramp": ["--copy-load-growth", "2", "--copy-load-chunk-size", "32MiB"],
             "memcpy_large": ["--copy-large-runs", "memcpy"],
             # the kernel ways for saves too (by default a save runs no kernel)
             "kernel_large": ["--copy-large-runs", "kernel", "--copy-save-kernels"],
             "staged_large": ["--copy-large-runs", "staged", "--copy-save-kernels"],
             # loads through a device staging slot (one bus copy where the pool's blocks are
             # contiguous, a scatter kernel into the engine's), saves on the copy engines
             "staged_loads": ["--copy-large-runs", "staged"],
             "packed_large": ["--copy-packed-min-pieces", "1", "--copy-save-kernels"],
             "batch_keeps_gil": ["--copy-batch-keeps-gil"],
             # copies waited for by polling their events (s38), not in cudaEventSynchronize
             "wait_polled": ["--copy-wait-poll-us", "20"],
             "chunk_16m": ["--copy-chunk-size", "16MiB"],
             "chunk_64m": ["--copy-chunk-size", "64MiB", "--copy-staging-slot-size", "64MiB"],
             "chunk_128m": ["--copy-chunk-size", "128MiB", "--copy-staging-slot-size",
                            "128MiB"]}
def _raw_row(cp, n: int, dev: int, alloc_host: int, pool_host: int, reps: int) -> dict:
    """Raw single-memcpy bandwidth (GB/s) of n blocks, both directions, both kinds of pinning."""
    nbytes = n * BLOCK_BYTES
    stream = cp.cuda.Stream(non_blocking=True)
    out = {}
    for name, host in (("raw", alloc_host), ("raw_registered", pool_host)):
        d2h = cuda_median_ms(cp, lambda h=host: cp.cuda.runtime.memcpyAsync(h, dev, nbytes, 2,
                                                                         stream.ptr), reps, stream)
        h2d = cuda_median_ms(cp, lambda h=host: cp.cuda.runtime.memcpyAsync(dev, h, nbytes, 1,
                                                                         stream.ptr), reps, stream)
        out[f"{name}_d2h_gbps"] = nbytes / d2h / 1e6
        out[f"{name}_h2d_gbps"] = nbytes / h2d / 1e6
    return out


def _copier_row(n: int, dev: int, host: int, block_ids: list[int], reps: int) -> dict:
    """The copier alone in this process: shuffled blocks to and from consecutive pool slots."""
    from kvstore.engines.copier import CudaCopier
    from kvstore.engines.run_arrays import CopyRun

    out = {}
    copier = CudaCopier(0)
    pairs = [(dev + b * BLOCK_BYTES, host + j * BLOCK_BYTES) for j, b in enumerate(block_ids)]
    for way, runs, fn in (
            ("d2h", [CopyRun(d, h, BLOCK_BYTES) for d, h in pairs], copier.device_to_host),
            ("h2d", [CopyRun(h, d, BLOCK_BYTES) for d, h in pairs], copier.host_to_device)):
        times = []
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            fn(runs).wait()
            if rep:
                times.append(time.perf_counter() - t0)
        out[f"copier_{way}_gbps"] = n * BLOCK_BYTES / float(np.median(times)) / 1e9
    return out


def _daemon_row(client, reg: int, namespace: bytes, block_ids: list[int], reps: int) -> dict:
    """Median wall-clock ms of save, lookup and load of ``block_ids`` through the daemon."""
    n = len(block_ids)
    save_ms, lookup_ms, load_ms = [], [], []
    before: dict = {}
    before_copy: dict = {}
    for rep in range(reps + 1):  # the first rep warms up
        if rep == 1:  # the daemon's own figures below leave the warm-up out too
            before_stats = client.stats()["daemon"]
            before = before_stats.get("request_ms", {})
            before_copy = before_stats.get("copy_ms", {})
        hashes = [os.urandom(16) for _ in range(n)]
        idents = [os.urandom(IDENT_BYTES) for _ in range(n)]
        t0 = time.perf_counter()
        reply = client.save(reg, namespace, block_ids, hashes, idents)
        t1 = time.perf_counter()
        hit = client.lookup(namespace, hashes, idents)
        t2 = time.perf_counter()
        num_loaded = client.load(reg, hit.lease_id, block_ids)
        t3 = time.perf_counter()
        client.remove(namespace, hashes)
        if reply.num_saved != n or hit.num_hit != n or num_loaded != n:
            raise RuntimeError(f"{n} blocks: saved {reply.num_saved}, hit {hit.num_hit}, "
                               f"loaded {num_loaded}")
        if rep:
            save_ms.append((t1 - t0) * 1e3)
            lookup_ms.append((t2 - t1) * 1e3)
            load_ms.append((t3 - t2) * 1e3)
    row = {"save_ms": float(np.median(save_ms)), "lookup_ms": float(np.median(lookup_ms)),
           "load_ms": float(np.median(load_ms))}
    # The daemon's own time per request, from reading the frame to the reply ready (its
    # ``request_ms``; a mean over the timed reps, where the client's figures are medians): the
    # rest of the client's time is the socket, the reply's way out and the client.
    after_stats = client.stats()["daemon"]
    for verb, sums in _per_call(after_stats.get("request_ms", {}), before, "count").items():
        if verb in ("save", "lookup", "load"):
            row[f"daemon_{verb}_ms"] = sums["sum_ms"]
    # The copies' phases per call (``daemon.copy_ms``, means over the timed reps).
    for way, phases in _per_call(after_stats.get("copy_ms", {}), before_copy, "calls").items():
        row[f"daemon_{way}_phases_ms"] = phases
    return row


def _per_call(after: dict, before: dict, calls_key: str) -> dict[str, dict[str, float]]:
    """Per key of two snapshots of summed counters (``{key: {calls_key: n, name: sum}}``), what
    was added between them divided by the calls added; keys without a call left out."""
    out = {}
    for key, sums in after.items():
        old = before.get(key, {})
        calls = sums.get(calls_key, 0) - old.get(calls_key, 0)
        if calls > 0:
            out[key] = {k: (v - old.get(k, 0)) / calls for k, v in sums.items() if k != calls_key}
    return out


def _streamed_row(client, reg: int, namespace: bytes, block_ids: list[int], reps: int,
                  depth: int) -> dict:
    """Median wall-clock ms of ``depth`` concurrent saves, then of ``depth`` concurrent loads."""
    n = len(block_ids)
    save_ms, load_ms = [], []
    for rep in range(reps + 1):
        chains = [([os.urandom(16) for _ in range(n)], [os.urandom(IDENT_BYTES) for _ in range(n)])
                  for _ in range(depth)]
        t0 = time.perf_counter()
        saves = [client.save_async(reg, namespace, block_ids, h, i) for h, i in chains]
        num_saved = sum(p.wait().num_saved for p in saves)
        t1 = time.perf_counter()
        leases = [client.lookup(namespace, h, i).lease_id for h, i in chains]
        t2 = time.perf_counter()
        loads = [client.load_async(reg, lease, block_ids) for lease in leases]
        num_loaded = sum(p.wait() for p in loads)
        t3 = time.perf_counter()
        for h, _ in chains:
            client.remove(namespace, h)
        if num_saved != depth * n or num_loaded != depth * n:
            raise RuntimeError(f"streamed {depth} x {n}: saved {num_saved}, loaded {num_loaded}")
        if rep:
            save_ms.append((t1 - t0) * 1e3)
            load_ms.append((t3 - t2) * 1e3)
    return {"save_ms": float(np.median(save_ms)), "load_ms": float(np.median(load_ms))}


def _byte_exact(cp, client, reg: int, namespace: bytes, kv, block_ids: list[int]) -> bool:
    """Save, scramble the arena, load back into the same ids: the blocks must come back."""
    hashes = [os.urandom(16) for _ in block_ids]
    idents = [os.urandom(IDENT_BYTES) for _ in block_ids]
    expect = kv[block_ids].copy()
    if client.save(reg, namespace, block_ids, hashes, idents).num_saved != len(block_ids):
        return False
    kv[...] = 0
    cp.cuda.Device().synchronize()
    hit = client.lookup(namespace, hashes, idents)
    num_loaded = client.load(reg, hit.lease_id, block_ids)
    ok = num_loaded == len(block_ids) and bool(cp.array_equal(kv[block_ids], expect))
    client.remove(namespace, hashes)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="64,256,1024")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--depth", type=int, default=4, help="requests in flight, streamed")
    parser.add_argument("--variants", default="default", type=names_arg(_VARIANTS),
                        help="comma-separated: " + ", ".join(_VARIANTS))
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--trace", action="store_true",
                        help="a timeline of every daemon save/load (benchmarks/copy_trace.py)")
    parser.add_argument("--request-trace", action="store_true",
                        help="each request's stages, socket to reply "
                             "(benchmarks/request_trace.py)")
    args = parser.parse_args(argv)
    if args.trace and args.request_trace:
        parser.error("--trace and --request-trace wrap the same calls: one at a time")

    import cupy as cp

    from kvstore import Client
    from kvstore.keys import Namespace
    from kvstore.layout import KVLayout, Region
    from kvstore.store.dram.pool import HostPool

    counts = [int(x) for x in args.blocks.split(",")]
    max_blocks = max(counts)
    total = max_blocks * BLOCK_BYTES
    memory = cp.cuda.Memory(total)  # its own allocation: an IPC handle names a whole one
    kv = cp.ndarray((max_blocks, BLOCK_BYTES), cp.uint8, cp.cuda.MemoryPointer(memory, 0))
    kv[...] = cp.random.RandomState(0).randint(0, 256, kv.shape, dtype=cp.uint8)
    pinned = cp.cuda.alloc_pinned_memory(total)
    alloc_host = np.frombuffer(pinned, dtype=np.uint8, count=total).ctypes.data
    pool = HostPool(total, pin=True)
    rng = np.random.default_rng(0)
    shuffled = {n: [int(b) for b in rng.permutation(max_blocks)[:n]] for n in counts}
    raw = {n: {**_raw_row(cp, n, memory.ptr, alloc_host, pool.base_address, args.reps),
               **_copier_row(n, memory.ptr, pool.base_address, shuffled[n], args.reps)}
           for n in counts}
    pool.close()
    for n in counts:  # the pipeline alone, in this process (see benchmarks/transfer_pipeline.py)
        raw[n].update(pipeline_rows(memory.ptr, BLOCK_BYTES, shuffled[n], args.reps))
    for n in counts:
        r = raw[n]
        print(f"{n:5d} blocks | raw d2h {r['raw_d2h_gbps']:5.1f} (registered "
              f"{r['raw_registered_d2h_gbps']:5.1f}) h2d {r['raw_h2d_gbps']:5.1f} (registered "
              f"{r['raw_registered_h2d_gbps']:5.1f}) | in-process copier, a call per shuffled "
              f"block: d2h {r['copier_d2h_gbps']:5.1f} h2d {r['copier_h2d_gbps']:5.1f} GB/s",
              flush=True)
        print(f"{n:5d} blocks | in-process pipeline: save {r['pipeline_save_ms']:.2f} ms "
              f"(first chunk enqueued at {r['pipeline_save_first_submit_ms']:.2f}, tail "
              f"{r['pipeline_save_tail_ms']:.2f}) load {r['pipeline_load_ms']:.2f} ms (first "
              f"{r['pipeline_load_first_submit_ms']:.2f}, tail {r['pipeline_load_tail_ms']:.2f})"
              f" | " + " ".join(f"{k[9:]}={v:.2f}" for k, v in r.items()
                                if k.startswith("pipeline_") and k.endswith("_ms")
                                and "first" not in k and "tail" not in k), flush=True)

    handle = bytes(cp.cuda.runtime.ipcGetMemHandle(memory.ptr))
    layout = KVLayout(max_blocks, (Region(handle, total, 0, BLOCK_BYTES, BLOCK_BYTES),),
                      device="cuda:0", dtype="bfloat16")
    namespace = Namespace(name="transfer-daemon").digest
    rows, exact, daemon_pinned = [], None, None
    round_trip_ms: dict[str, float] = {}
    for variant in args.variants:
        windows: list[tuple[dict, float, float]] = []  # each row's requests, for the stages
        modes = ["single", "single_consecutive", "streamed"] if variant == "default" else \
            ["single"]
        depth = args.depth if "streamed" in modes else 1
        trace = Path(args.out).resolve() / f"transfer_daemon-trace-{variant}.jsonl"
        stages = trace.with_name(f"transfer_daemon-stages-{variant}.jsonl")
        for path, wanted in ((trace, args.trace), (stages, args.request_trace)):
            if wanted:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.unlink(missing_ok=True)
        proc, socket_path = start_daemon(depth * total + (256 << 20), _VARIANTS[variant],
                                         trace if args.trace else None,
                                         request_trace=stages if args.request_trace else None)
        try:
            with Client(socket_path, timeout_s=120.0) as client:
                daemon_pinned = client.stats()["tiers"]["dram"]["pinned"]
                rtt_ms = [0.0] * 201
                for i in range(len(rtt_ms)):
                    t0 = time.perf_counter()
                    client.health()
                    rtt_ms[i] = (time.perf_counter() - t0) * 1e3
                round_trip_ms[variant] = float(np.median(rtt_ms[1:]))
                print(f"{variant:>14} health round trip {round_trip_ms[variant]:.3f} ms p50",
                      flush=True)
                reg = client.register(layout, "transfer-daemon")
                for n, mode in ((n, m) for n in counts for m in modes):
                    began = time.monotonic()
                    if mode == "streamed":
                        timed = _streamed_row(client, reg, namespace, shuffled[n], args.reps,
                                              depth)
                        nbytes = depth * n * BLOCK_BYTES
                    else:
                        block_ids = list(range(n)) if mode == "single_consecutive" else \
                            shuffled[n]
                        timed = _daemon_row(client, reg, namespace, block_ids, args.reps)
                        nbytes = n * BLOCK_BYTES
                    row = {"variant": variant, "mode": mode, "blocks": n, "bytes": nbytes,
                           "depth": depth if mode == "streamed" else 1, **raw[n], **timed}
                    windows.append((row, began, time.monotonic()))
                    row["daemon_save_gbps"] = nbytes / row["save_ms"] / 1e6
                    row["daemon_load_gbps"] = nbytes / row["load_ms"] / 1e6
                    row["ratio_save"] = row["daemon_save_gbps"] / row["raw_d2h_gbps"]
                    row["ratio_load"] = row["daemon_load_gbps"] / row["raw_h2d_gbps"]
                    rows.append(row)
                    lookup = f" | lookup {row['lookup_ms']:.2f} ms" if "lookup_ms" in row else ""
                    if "daemon_save_ms" in row:
                        lookup += (f" | client / daemon ms: save {row['save_ms']:.2f} / "
                                   f"{row['daemon_save_ms']:.2f}, load {row['load_ms']:.2f} / "
                                   f"{row.get('daemon_load_ms', float('nan')):.2f}")
                    print(f"{variant:>14} {mode:>18} {n:5d} blocks | save "
                          f"{row['daemon_save_gbps']:5.1f} GB/s = {row['ratio_save']:.2f} of raw"
                          f" | load {row['daemon_load_gbps']:5.1f} GB/s = "
                          f"{row['ratio_load']:.2f} of raw{lookup}", flush=True)
                    for way in ("save", "load"):
                        phases = row.get(f"daemon_{way}_phases_ms")
                        if phases:
                            print(f"{variant:>14} {mode:>18} {n:5d} blocks | {way} phases, ms "
                                  "per call: " + " ".join(f"{k}={v:.3f}"
                                                          for k, v in phases.items()),
                                  flush=True)
                if variant == "default":
                    exact = _byte_exact(cp, client, reg, namespace, kv, shuffled[max_blocks])
                client.unregister(reg)
        finally:
            stop_daemon(proc, socket_path)
        if args.trace:
            from benchmarks.copy_trace import summarize

            for row in summarize(str(trace)):
                print(f"{variant:>14} trace " + " ".join(
                    f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in row.items()), flush=True)
        if args.request_trace:
            from benchmarks.request_trace import summarize as stage_gaps

            for row, began, ended in windows:  # the requests each row timed, apart
                row["stages_us_p10_p50_p90"] = stage_gaps(stages, window=(began, ended),
                                                          spread=True)
                for what, gaps in row["stages_us_p10_p50_p90"].items():
                    print(f"{variant:>14} {row['mode']:>18} stages, us p10/p50/p90, {what}: "
                          + " ".join(f"{k}={'/'.join(f'{x:g}' for x in v)}"
                                     for k, v in gaps.items() if k != "requests")
                          + f" ({gaps['requests']} requests)", flush=True)

    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"]
    out = {
        "block_bytes": BLOCK_BYTES, "rows": rows,
        "byte_exact": exact, "daemon_pool_pinned": daemon_pinned,
        "health_round_trip_ms_p50": round_trip_ms,
        "timing": "daemon: wall clock around Client.save/load (socket, msgpack, worker thread "
                  "included; streamed: depth requests in flight, bytes of all of them), median "
                  "of reps after one warm-up; raw: CUDA events around one cudaMemcpyAsync of "
                  "the blocks' bytes; ratio = daemon / raw (cudaHostAlloc) of the same row",
    }
    print(f"byte-exact save/scramble/load through the daemon: {exact}; daemon pool pinned: "
          f"{daemon_pinned}")
    finish("transfer_daemon", out, args.out, argv, machine={
        "node": platform.node(), "gpu": gpu.decode() if isinstance(gpu, bytes) else str(gpu),
        "cpus": os.cpu_count()})
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
