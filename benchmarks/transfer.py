"""Save/load bandwidth of whole KV blocks, HBM <-> pinned DRAM, against raw pinned cudaMemcpy.

Qwen3-4B layout: 36 layers x K,V x 16 tokens x 8 KV heads x 128 dims x bf16 = 2.36 MB per block.
For 64/256/1,024 blocks, in one run: a raw single cudaMemcpyAsync of the same bytes, our batched
copier (one cudaMemcpyAsync per block into shuffled pool slots, coalesced where contiguous) and the
gather/scatter kernel (one launch for the batch, reading/writing mapped pinned memory). Also the
slow-down of a decode-like GEMM loop while a save runs. Writes JSON to benchmarks/results/.

    python -m benchmarks.transfer [--blocks 64,256,1024] [--reps 10]
"""

from __future__ import annotations

import argparse
import platform

import numpy as np

from benchmarks.common import cuda_median_ms, finish

BLOCK_BYTES = 36 * 2 * 16 * 8 * 128 * 2


def _measure_row(cp, copier, stream, n: int, max_blocks: int, dev_base: int, host_base: int,
                 rng, reps: int) -> dict:
    """One table row: raw memcpy, batched memcpy and the copy kernel for ``n`` shuffled blocks."""
    from kernels.block_copy import copy_runs
    from kvstore.engines.run_arrays import CopyRun

    nbytes = n * BLOCK_BYTES
    dev = [dev_base + int(b) * BLOCK_BYTES for b in rng.permutation(max_blocks)[:n]]
    hst = [host_base + int(s) * BLOCK_BYTES for s in rng.permutation(max_blocks)[:n]]
    save_runs = [CopyRun(d, h, BLOCK_BYTES) for d, h in zip(dev, hst, strict=True)]
    load_runs = [CopyRun(h, d, BLOCK_BYTES) for d, h in zip(dev, hst, strict=True)]
    d2h, h2d = copier._streams[2], copier._streams[1]
    cases = {
        "raw_d2h": (lambda: cp.cuda.runtime.memcpyAsync(host_base, dev_base, nbytes, 2, d2h.ptr),
                    d2h),
        "raw_h2d": (lambda: cp.cuda.runtime.memcpyAsync(dev_base, host_base, nbytes, 1, h2d.ptr),
                    h2d),
        "ours_memcpy_d2h": (lambda: copier.device_to_host(save_runs), d2h),
        "ours_memcpy_h2d": (lambda: copier.host_to_device(load_runs), h2d),
        "ours_kernel_d2h": (lambda: copy_runs(dev, hst, BLOCK_BYTES, stream=stream,
                                              blocks_per_run=32), stream),
        "ours_kernel_h2d": (lambda: copy_runs(hst, dev, BLOCK_BYTES, stream=stream,
                                              blocks_per_run=32), stream),
    }
    res: dict = {"blocks": n, "bytes": nbytes}
    for name, (fn, strm) in cases.items():
        res[name + "_gbps"] = nbytes / cuda_median_ms(cp, fn, reps, strm) / 1e6
    for way in ("d2h", "h2d"):
        best = max(res[f"ours_memcpy_{way}_gbps"], res[f"ours_kernel_{way}_gbps"])
        res[f"ratio_{way}"] = best / res[f"raw_{way}_gbps"]
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="64,256,1024")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)

    import cupy as cp

    from kvstore.engines.copier import CudaCopier
    from kvstore.engines.run_arrays import CopyRun

    counts = [int(x) for x in args.blocks.split(",")]
    max_blocks = max(counts)
    total = max_blocks * BLOCK_BYTES
    arena = cp.random.randint(0, 255, size=total, dtype=cp.uint8)
    pinned = cp.cuda.alloc_pinned_memory(total)
    host = np.frombuffer(pinned, dtype=np.uint8, count=total)
    host_base = host.ctypes.data
    dev_base = arena.data.ptr
    copier = CudaCopier(0)
    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    rows = [_measure_row(cp, copier, stream, n, max_blocks, dev_base, host_base, rng, args.reps)
            for n in counts]
    for res in rows:
        print(f"{res['blocks']:5d} blocks | d2h raw {res['raw_d2h_gbps']:5.1f}"
              f" memcpy {res['ours_memcpy_d2h_gbps']:5.1f}"
              f" kernel {res['ours_kernel_d2h_gbps']:5.1f}"
              f" | h2d raw {res['raw_h2d_gbps']:5.1f} memcpy {res['ours_memcpy_h2d_gbps']:5.1f}"
              f" kernel {res['ours_kernel_h2d_gbps']:5.1f} GB/s"
              f" | best/raw d2h {res['ratio_d2h']:.2f} h2d {res['ratio_h2d']:.2f}")

    # Byte-exactness of the path we measured: save, scramble the arena, load back, compare.
    n = max_blocks
    dev = [dev_base + b * BLOCK_BYTES for b in range(n)]
    hst = [host_base + int(s) * BLOCK_BYTES for s in rng.permutation(n)]
    expect = arena.copy()
    pairs = list(zip(dev, hst, strict=True))
    copier.device_to_host([CopyRun(d, h, BLOCK_BYTES) for d, h in pairs]).wait()
    arena.fill(0)
    copier.host_to_device([CopyRun(h, d, BLOCK_BYTES) for d, h in pairs]).wait()
    exact = bool(cp.array_equal(arena, expect))

    # A save running beside a decode-sized GEMM loop: how much slower the GEMMs get.
    half = getattr(cp, "bfloat16", cp.float16)
    a = cp.random.standard_normal((1, 2560), dtype=cp.float32).astype(half)
    w = cp.random.standard_normal((9728, 2560), dtype=cp.float32).astype(half)
    compute = cp.cuda.Stream(non_blocking=True)

    def decode_like():
        with compute:
            for _ in range(50):
                a @ w.T

    alone = cuda_median_ms(cp, decode_like, args.reps, compute)
    runs = [CopyRun(d, h, BLOCK_BYTES) for d, h in pairs]
    copier.device_to_host(runs)
    beside = cuda_median_ms(cp, decode_like, 3, compute)
    stream.synchronize()
    out = {
        "block_bytes": BLOCK_BYTES, "rows": rows, "byte_exact": exact,
        "decode_gemm_ms_alone": alone, "decode_gemm_ms_during_save": beside,
    }
    print(f"byte-exact round trip: {exact}; decode GEMM loop {alone:.2f} ms alone, "
          f"{beside:.2f} ms during a save")
    finish("transfer", out, args.out, argv, machine={
        "node": platform.node(), "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()})
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
