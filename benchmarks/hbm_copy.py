"""HBM-tier copy bandwidth through the daemon against a raw device-to-device copy, one run.

Two engine arenas (Qwen3-4B layout, 2.36 MB blocks, 1,024 blocks each, own cudaMalloc) live in
this process; a real `kvstore serve` subprocess opens both by CUDA IPC handle. The owner publishes
its blocks as resident (``resident``, with its block generations); the reader looks them up (tier
"hbm") and loads them into its own arena: the daemon copies device to device on its copy stream,
checking each block's generation before and after. For 64/256/1,024 blocks (shuffled ids on both
sides, and consecutive ids) it times by wall clock the reader's ``load`` (socket, msgpack, worker
thread, generation checks included) and its ``lookup`` apart; by CUDA events one raw
cudaMemcpyAsync device to device of the same bytes, and, as the ceiling of a call per block, the
daemon's copier alone in this process with the same runs. Ratio = daemon load / raw.

``--reader-device N`` puts the reader's arena on GPU N (the owner's stays on GPU 0): the daemon
then copies between the GPUs (peer access: NVLink or PCIe), as for two engines of a node.

    python -m benchmarks.hbm_copy [--blocks 64,256,1024] [--reps 10] [--reader-device N]
                                  [--out DIR] [--profile FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_daemon import start_daemon, stop_daemon
from benchmarks.common import command, cuda_median_ms, now_iso, today, write_result
from benchmarks.transfer_daemon import IDENT_BYTES

BLOCK_BYTES = 36 * 2 * 16 * 8 * 128 * 2


class _Arena:
    def __init__(self, cp, num_blocks: int, seed: int | None) -> None:
        from kvstore.layout import KVLayout, Region
        from offload.block_generations import BlockGenerations

        self.memory = cp.cuda.Memory(num_blocks * BLOCK_BYTES)  # an IPC handle names all of it
        self.kv = cp.ndarray((num_blocks, BLOCK_BYTES), cp.uint8,
                             cp.cuda.MemoryPointer(self.memory, 0))
        if seed is None:
            self.kv[...] = 0
        else:
            self.kv[...] = cp.random.RandomState(seed).randint(0, 256, self.kv.shape,
                                                               dtype=cp.uint8)
        cp.cuda.Device().synchronize()
        self.generations = BlockGenerations(num_blocks)
        handle = bytes(cp.cuda.runtime.ipcGetMemHandle(self.memory.ptr))
        self.layout = KVLayout(num_blocks, (Region(handle, num_blocks * BLOCK_BYTES, 0,
                                                   BLOCK_BYTES, BLOCK_BYTES),),
                               device=f"cuda:{cp.cuda.Device().id}", dtype="bfloat16"
                               ).with_generations(self.generations.fd)


def _raw_row(cp, n: int, src: int, dst: int, src_ids: list[int], dst_ids: list[int],
             reps: int) -> dict:
    """CUDA-event bandwidths (GB/s): one memcpy of n blocks' bytes, and the copier's runs."""
    from kvstore.engines.copier import CudaCopier
    from kvstore.engines.copy_settings import CopyMethod
    from kvstore.engines.run_arrays import CopyRun

    nbytes = n * BLOCK_BYTES
    stream = cp.cuda.Stream(non_blocking=True)
    raw_ms = cuda_median_ms(
        cp, lambda: cp.cuda.runtime.memcpyAsync(dst, src, nbytes, 4, stream.ptr), reps, stream)
    copier = CudaCopier(cp.cuda.Device().id)
    runs = [CopyRun(src + s * BLOCK_BYTES, dst + d * BLOCK_BYTES, BLOCK_BYTES)
            for s, d in zip(src_ids, dst_ids, strict=True)]
    merged, kind, method = copier.device_to_device_plan(runs)
    out = {"raw_d2d_gbps": nbytes / raw_ms / 1e6, "copier_method": method.value}
    methods = {"": None, **{f"_{m.value}": m for m in (CopyMethod.MEMCPY, CopyMethod.BATCH,
                                                          CopyMethod.KERNEL)}}
    for suffix, forced in methods.items():
        times = []
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            if forced is None:
                copier.device_to_device(runs).wait()
            else:  # the copier's methods one by one, on the runs the daemon would submit
                copier._submit(merged, kind, forced).wait()
            if rep:
                times.append(time.perf_counter() - t0)
        out[f"copier{suffix}_d2d_gbps"] = nbytes / float(np.median(times)) / 1e9
    return out


def _daemon_row(owner, reader, reg_owner: int, reg_reader: int, namespace: bytes, owner_arena,
                src_ids: list[int], dst_ids: list[int], reps: int) -> dict:
    """Wall-clock ms of the reader's lookup and load (median of reps after one warm-up)."""
    n = len(src_ids)
    hashes = [os.urandom(16) for _ in range(n)]
    idents = [os.urandom(IDENT_BYTES) for _ in range(n)]
    gens = []
    for b in src_ids:
        owner_arena.generations.bump(b)
        gens.append(owner_arena.generations.get(b))
    if owner.resident(reg_owner, namespace, src_ids, hashes, idents, gens) != n:
        raise RuntimeError("the daemon did not index every published block")
    lookup_ms, load_ms = [], []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        hit = reader.lookup(namespace, hashes, idents)
        t1 = time.perf_counter()
        num_loaded = reader.load(reg_reader, hit.lease_id, dst_ids)
        t2 = time.perf_counter()
        if hit.num_hit != n or set(hit.tiers) != {"hbm"} or num_loaded != n:
            raise RuntimeError(f"{n} blocks: hit {hit.num_hit} ({set(hit.tiers)}), "
                               f"loaded {num_loaded}")
        if rep:
            lookup_ms.append((t1 - t0) * 1e3)
            load_ms.append((t2 - t1) * 1e3)
    owner.evicted(namespace, hashes, reg_owner)
    return {"lookup_ms": float(np.median(lookup_ms)), "load_ms": float(np.median(load_ms))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="64,256,1024")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--reader-device", type=int, default=0,
                        help="the GPU of the reader's arena (the owner's is GPU 0)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--profile", type=Path, default=None, metavar="FILE",
                        help="write the daemon's sampled stacks here (benchmarks.stack_sampler)")
    args = parser.parse_args(argv)

    import cupy as cp

    from kvstore import Client
    from kvstore.keys import Namespace

    counts = [int(x) for x in args.blocks.split(",")]
    max_blocks = max(counts)
    owner_arena = _Arena(cp, max_blocks, seed=0)
    with cp.cuda.Device(args.reader_device):
        reader_arena = _Arena(cp, max_blocks, None)
    if args.reader_device != 0:  # this process's own copies (the raw rows) cross the GPUs too
        cp.cuda.runtime.deviceEnablePeerAccess(args.reader_device)
    rng = np.random.default_rng(0)
    cases = {}
    for n in counts:
        cases[(n, "shuffled")] = ([int(b) for b in rng.permutation(max_blocks)[:n]],
                                  [int(b) for b in rng.permutation(max_blocks)[:n]])
        cases[(n, "consecutive")] = (list(range(n)), list(range(n)))
    namespace = Namespace(name="hbm-copy").digest
    rows = []
    proc, socket_path = start_daemon(256 << 20, profile=args.profile)
    try:
        with Client(socket_path, timeout_s=120.0) as owner, \
                Client(socket_path, timeout_s=120.0) as reader:
            reg_owner = owner.register(owner_arena.layout, "hbm-owner")
            reg_reader = reader.register(reader_arena.layout, "hbm-reader")
            for (n, mode), (src_ids, dst_ids) in cases.items():
                row = {"blocks": n, "mode": mode, "bytes": n * BLOCK_BYTES,
                       **_raw_row(cp, n, owner_arena.memory.ptr, reader_arena.memory.ptr,
                                  src_ids, dst_ids, args.reps),
                       **_daemon_row(owner, reader, reg_owner, reg_reader, namespace,
                                     owner_arena, src_ids, dst_ids, args.reps)}
                row["daemon_load_gbps"] = row["bytes"] / row["load_ms"] / 1e6
                row["ratio_load"] = row["daemon_load_gbps"] / row["raw_d2d_gbps"]
                rows.append(row)
                print(f"{mode:>12} {n:5d} blocks | raw d2d {row['raw_d2d_gbps']:7.1f} GB/s | "
                      f"copier alone {row['copier_d2d_gbps']:7.1f} ({row['copier_method']}; "
                      f"memcpy {row['copier_memcpy_d2d_gbps']:.0f}, batch "
                      f"{row['copier_batch_d2d_gbps']:.0f}, kernel "
                      f"{row['copier_kernel_d2d_gbps']:.0f}) | daemon load "
                      f"{row['daemon_load_gbps']:7.1f} GB/s ({row['load_ms']:.2f} ms) = "
                      f"{row['ratio_load']:.2f} of raw | lookup {row['lookup_ms']:.2f} ms",
                      flush=True)
            # Byte-exactness of what was measured: the last load's blocks are the owner's.
            src_ids, dst_ids = cases[(max_blocks, "shuffled")]
            with cp.cuda.Device(args.reader_device):
                reader_arena.kv[...] = 0
                cp.cuda.Device().synchronize()
            _daemon_row(owner, reader, reg_owner, reg_reader, namespace, owner_arena, src_ids,
                        dst_ids, 1)
            with cp.cuda.Device(args.reader_device):  # each arena read on its own GPU
                got = cp.asnumpy(reader_arena.kv[dst_ids])
            exact = bool(np.array_equal(got, cp.asnumpy(owner_arena.kv[src_ids])))
            stats = reader.stats()["tiers"]["hbm"]
    finally:
        stop_daemon(proc, socket_path)
    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"]
    out = {
        "benchmark": "hbm_copy", "block_bytes": BLOCK_BYTES, "rows": rows, "byte_exact": exact,
        "owner_device": 0, "reader_device": args.reader_device,
        "hbm_tier_stats": stats,
        "timing": "daemon: wall clock around Client.load of blocks the lookup found in the "
                  "owner's arena (socket, msgpack, worker thread, generation checks included), "
                  "median of reps after one warm-up; raw: CUDA events around one "
                  "cudaMemcpyAsync device to device of the same bytes; copier: wall clock of "
                  "the daemon's copier in this process, one call per block (coalesced when "
                  "consecutive); ratio = daemon / raw",
        "machine": {"node": platform.node(), "gpu": gpu.decode() if isinstance(gpu, bytes)
                    else str(gpu), "cpus": os.cpu_count()},
        "date": now_iso(),
        "command": command("python -m benchmarks.hbm_copy", argv),
    }
    print(f"byte-exact: {exact}")
    name = "hbm-copy" if args.reader_device == 0 else f"hbm-copy-gpu0-to-gpu{args.reader_device}"
    path = write_result(args.out, f"{name}-{today()}.json", out)
    print(f"wrote {path}")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
