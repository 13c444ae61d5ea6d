"""How a copy is waited for: a blocking-sync event against polling, wall clock and CPU, one run.

For 64 and 256 shuffled 2.36 MB blocks (Qwen3-4B's block-major block), each way (pinned host to
device and back), one ``cuMemcpyBatchAsync`` of a run per block, as the daemon's copier submits
a load or save chunk, then a wait for its event by each way the copier could take:

- ``blocking``: ``cudaEventSynchronize`` on a blocking-sync event (the thread sleeps until the
  driver wakes it: the copier's wait before s38, ``--copy-wait-poll-us 0``);
- ``spin``: ``cudaEventSynchronize`` on a spinning event (a core busy for the whole copy);
- ``poll_Nus``: ``CopyHandle.wait`` as shipped: asleep until the bytes could have crossed at
  ``PEAK_BYTES_PER_S``, then the event asked every N us (20: the default);
- ``poll_only_20us``: asked every 20 us from the start (no sleep first).

Reported per way: the median wall time from submission to the wait's return against the batch's
own GPU time (CUDA events around it, measured beside: the floor any wait can reach), and the
median CPU time of the waiting thread (``time.thread_time``).

    python -m benchmarks.copy_wait [--blocks 64,256] [--reps 40] [--out DIR]
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from benchmarks.common import finish

BLOCK_BYTES = 2_359_296
POOL_BLOCKS = 1024


def _waits(fault):
    """(name, blocking event?, wait(event, num_bytes)) for each way compared."""
    from kvstore.engines.copy_handle import CopyHandle

    def synchronize(event, num_bytes: int) -> None:
        event.synchronize()

    def handle(poll_s: float):
        def wait(event, num_bytes: int) -> None:
            CopyHandle(event, num_bytes, fault, poll_s).wait()
        return wait

    def poll_only(event, num_bytes: int) -> None:
        while not event.done:
            time.sleep(20e-6)

    return [("blocking", True, synchronize), ("spin", False, synchronize),
            ("poll_20us", True, handle(20e-6)), ("poll_100us", True, handle(100e-6)),
            ("poll_only_20us", True, poll_only)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", default="64,256")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    import cupy as cp

    from kvstore.engines import cuda_batch
    from kvstore.engines.cuda_fault import CudaFault
    from kvstore.engines.run_arrays import RunArrays

    device = cp.cuda.alloc(POOL_BLOCKS * BLOCK_BYTES)
    host = cp.cuda.alloc_pinned_memory(POOL_BLOCKS * BLOCK_BYTES)
    stream = cp.cuda.Stream(non_blocking=True)
    waits = _waits(CudaFault())
    rows = []
    for n in (int(x) for x in args.blocks.split(",")):
        rng = random.Random(n)
        host_ptrs = np.array([host.ptr + b * BLOCK_BYTES
                              for b in rng.sample(range(POOL_BLOCKS), n)], np.int64)
        dev_ptrs = np.array([device.ptr + b * BLOCK_BYTES
                             for b in rng.sample(range(POOL_BLOCKS), n)], np.int64)
        sizes = np.full(n, BLOCK_BYTES, np.int64)
        for way, runs, src_dev, dst_dev in (
                ("h2d", RunArrays(host_ptrs, dev_ptrs, sizes), False, True),
                ("d2h", RunArrays(dev_ptrs, host_ptrs, sizes), True, False)):
            def submit(runs=runs, src_dev=src_dev, dst_dev=dst_dev) -> None:
                cuda_batch.memcpy_batch(runs, stream.ptr, src_dev, dst_dev, 0, keep_gil=False)

            row = {"blocks": n, "way": way, "bytes": n * BLOCK_BYTES}
            gpu_ms, wall, cpu = [], {name: [] for name, _, _ in waits}, \
                {name: [] for name, _, _ in waits}
            for rep in range(args.reps + 2):  # interleaved: drift touches every way alike
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(stream)
                submit()
                end.record(stream)
                end.synchronize()
                gpu_ms.append(cp.cuda.get_elapsed_time(start, end))
                for name, blocking, wait in waits:
                    c0, t0 = time.thread_time(), time.perf_counter()
                    submit()
                    event = cp.cuda.Event(block=blocking, disable_timing=True)
                    event.record(stream)
                    wait(event, n * BLOCK_BYTES)
                    if rep >= 2:  # two warm-ups
                        wall[name].append((time.perf_counter() - t0) * 1e3)
                        cpu[name].append((time.thread_time() - c0) * 1e3)
            row["gpu_ms"] = float(np.median(gpu_ms[2:]))
            for name in wall:
                row[f"{name}_wall_ms"] = float(np.median(wall[name]))
                row[f"{name}_cpu_ms"] = float(np.median(cpu[name]))
                row[f"{name}_gpu_over_wall"] = row["gpu_ms"] / row[f"{name}_wall_ms"]
            rows.append(row)
            print(f"{n:5d} blocks {way}: batch GPU time {row['gpu_ms']:.3f} ms", flush=True)
            for name in wall:
                print(f"    {name:>15}: wall {row[f'{name}_wall_ms']:.3f} ms "
                      f"(GPU/wall {row[f'{name}_gpu_over_wall']:.3f}), waiting thread's CPU "
                      f"{row[f'{name}_cpu_ms']:.3f} ms", flush=True)
    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"]
    finish("copy_wait", {
        "block_bytes": BLOCK_BYTES, "rows": rows, "gpu": gpu.decode() if isinstance(
            gpu, bytes) else str(gpu),
        "timing": "wall: submission to the wait's return (perf_counter), median of reps after "
                  "two warm-ups, ways interleaved per rep; gpu: CUDA events around the same "
                  "batch; cpu: the waiting thread's time.thread_time"}, args.out, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
