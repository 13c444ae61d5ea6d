"""The copier's ways of moving a batch of blocks against one raw cudaMemcpy of the same bytes.

In this process, no daemon: a vLLM-layout engine (36 layers, K and V tensors: 72 pieces of 32 KiB
per 2.36 MB block) and a block-major arena (one 2.36 MB run per block), shuffled block ids to
shuffled slots of a cudaHostRegister'd ``HostPool`` (the daemon's pinned pool). Each method is one
submission of the whole batch, timed by wall clock from building the runs (``PieceTable``) to the
event: ``staged`` (gathered on the GPU, a run per block across the bus), ``kernel`` (``copy_runs``
over mapped memory, at several ``UNROLL``s), ``batch`` (``cuMemcpyBatchAsync``) and ``memcpy`` (a
``cudaMemcpyAsync`` per run), each by a copier whose ``CopySettings`` name that method. Raw: CUDA
events around one ``cudaMemcpyAsync``.

    python -m benchmarks.copy_paths [--blocks 64,256] [--reps 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import cuda_median_ms, finish

PIECE = 16 * 8 * 128 * 2
NUM_LAYERS = 36
BLOCK_BYTES = 2 * NUM_LAYERS * PIECE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="64,256")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--unrolls", default="4,8")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)

    import cupy as cp

    from kernels import block_copy
    from kvstore.engines import cuda_batch
    from kvstore.engines.copier import CudaCopier
    from kvstore.engines.copy_settings import CopyMethod, CopySettings
    from kvstore.engines.run_arrays import PieceTable
    from kvstore.layout import KVLayout, Region
    from kvstore.store.dram.pool import HostPool

    counts = [int(x) for x in args.blocks.split(",")]
    num_blocks = max(counts) * 2
    layers = [cp.empty(2 * num_blocks * PIECE, dtype=cp.uint8) for _ in range(NUM_LAYERS)]
    vllm = KVLayout(num_blocks, tuple(
        Region(bytes(64), 2 * num_blocks * PIECE, kv * num_blocks * PIECE, PIECE, PIECE)
        for _ in layers for kv in range(2)), device="cuda:0", dtype="bfloat16")
    arena = cp.empty(num_blocks * BLOCK_BYTES, dtype=cp.uint8)
    major = KVLayout(num_blocks, (Region(bytes(64), num_blocks * BLOCK_BYTES, 0, BLOCK_BYTES,
                                         BLOCK_BYTES),), device="cuda:0", dtype="bfloat16")
    tables = {"vllm": PieceTable(vllm, [t.data.ptr for t in layers for _ in range(2)]),
              "block_major": PieceTable(major, [arena.data.ptr])}
    pool = HostPool(num_blocks * BLOCK_BYTES, pin=True)
    unrolls = [int(u) for u in args.unrolls.split(",")]
    copiers = {(m, u): CudaCopier(0, CopySettings(small_runs=m, large_runs=m, kernel_unroll=u))
               for m in CopyMethod for u in ([block_copy.UNROLL] if m != CopyMethod.KERNEL
                                             else unrolls)}
    stream = cp.cuda.Stream(non_blocking=True)
    methods = ["staged"] + [f"kernel_u{u}" for u in unrolls] + ["memcpy"]
    if cuda_batch.available():
        methods.append("batch")
    rng = np.random.default_rng(0)
    rows = []
    for n in counts:
        nbytes = n * BLOCK_BYTES
        raw = {"d2h": nbytes / cuda_median_ms(cp, lambda nb=nbytes: cp.cuda.runtime.memcpyAsync(
                   pool.base_address, arena.data.ptr, nb, 2, stream.ptr), args.reps,
                   stream) / 1e6,
               "h2d": nbytes / cuda_median_ms(cp, lambda nb=nbytes: cp.cuda.runtime.memcpyAsync(
                   arena.data.ptr, pool.base_address, nb, 1, stream.ptr), args.reps,
                   stream) / 1e6}
        ids = [int(b) for b in rng.permutation(num_blocks)[:n]]
        addrs = [pool.base_address + int(s) * BLOCK_BYTES
                 for s in rng.permutation(num_blocks)[:n]]
        for layout, table in tables.items():
            for method in methods:
                if method == "memcpy" and layout == "vllm" and n > 64:
                    continue  # ~6 GB/s (a call per 32 KiB piece): measured once is enough
                for way in ("d2h", "h2d"):
                    name = method.split("_")[0]
                    unroll = int(method.split("_u")[1]) if name == "kernel" \
                        else block_copy.UNROLL
                    copier = copiers[CopyMethod(name), unroll]
                    submit = copier.host_to_device if way == "h2d" else copier.device_to_host
                    times = []
                    for rep in range(args.reps + 1):
                        t0 = time.perf_counter()
                        submit(table.runs(ids, addrs, to_device=way == "h2d")).wait()
                        if rep:
                            times.append(time.perf_counter() - t0)
                    gbps = nbytes / float(np.median(times)) / 1e9
                    rows.append({"layout": layout, "blocks": n, "method": method, "way": way,
                                 "gbps": gbps, "raw_gbps": raw[way],
                                 "vs_raw": gbps / raw[way]})
                    print(f"{layout:>11} {n:5d} blocks {method:>10} {way}: {gbps:5.1f} GB/s = "
                          f"{gbps / raw[way]:.2f} of raw {raw[way]:.1f}", flush=True)
    pool.close()
    finish("copy_paths", {"rows": rows,
                          "timing": "wall clock from building the runs to the event, one "
                                    "submission per batch, median of reps after a warm-up; raw: "
                                    "CUDA events, one cudaMemcpyAsync"}, args.out, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
