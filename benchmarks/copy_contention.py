"""How much an engine's step slows while KV blocks cross the bus, by who copies them.

A first turn with write-through offload prefilled 1.07-1.14x slower than without on an H200
(``first_turn_cost``, 2026-12-03: the step's device time grew while an earlier prefill's saves
were copied out), and so did the long-context preset's first turns. This separates the causes,
one run, one GPU. The "step" is a prefill-shaped chain of fp16 matmuls timed by CUDA events
(its shape: ``--tokens`` rows through ``--layers`` pairs of 2,560 x 9,728 projections); it runs
while, in turn:

- ``none``: nothing else;
- ``d2h-thread``: a thread of this process copies a 1 GiB source (``--block-mb`` pieces, the
  daemon's runs) device to pinned host, over and over, on a stream of its own;
- ``d2h-process``: another process does the same from the same device memory, opened by CUDA
  IPC (the daemon's way: its saves read the engine's arena from another context);
- ``h2d-process``: that process copies pinned host to the device memory instead (a load);
- ``python-thread``: a thread of this process only runs Python (the GIL shared with the step's
  launches; a launch-bound step is timed too, by wall clock).

Reported per case: the step's median ms, its ratio to ``none`` and the copy's GB/s meanwhile.

    python -m benchmarks.copy_contention [--tokens 2048] [--layers 36] [--reps 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import threading
import time

from benchmarks.common import finish

HIDDEN, FFN = 2560, 9728
SOURCE_BYTES = 1 << 30
# The launch-bound step's kernels; the GIL's switch interval is kvengine serve's (a busy thread
# makes each launch that released the GIL wait up to one interval for it back).
LAUNCHES = 500
SWITCH_INTERVAL_S = 0.0005
CASES = ("none", "d2h-thread", "d2h-process", "h2d-process", "python-thread")


def _copy_loop(cp, device_ptr: int, host_ptr: int, piece: int, to_host: bool,
               stop, counter: list[int]) -> None:
    """Copy the source piece by piece (one cudaMemcpyAsync each) until ``stop`` is set."""
    stream = cp.cuda.Stream(non_blocking=True)
    kind = (cp.cuda.runtime.memcpyDeviceToHost if to_host
            else cp.cuda.runtime.memcpyHostToDevice)
    num_pieces = SOURCE_BYTES // piece
    with stream:
        while not stop.is_set():
            for off in range(0, num_pieces * piece, piece):
                dst, src = (host_ptr + off, device_ptr + off) if to_host else (
                    device_ptr + off, host_ptr + off)
                cp.cuda.runtime.memcpyAsync(dst, src, piece, kind, stream.ptr)
            stream.synchronize()
            counter[0] += num_pieces * piece


def _copier_process(handle: bytes, piece: int, to_host: bool, started, stop, result) -> None:
    """Another context: open the step process's memory by IPC handle and copy until stopped."""
    import cupy as cp
    device_ptr = cp.cuda.runtime.ipcOpenMemHandle(handle)
    host = cp.cuda.alloc_pinned_memory(SOURCE_BYTES)
    counter = [0]
    started.set()
    began = time.perf_counter()
    _copy_loop(cp, device_ptr, host.ptr, piece, to_host, stop, counter)
    result.value = counter[0] / (time.perf_counter() - began)
    cp.cuda.runtime.ipcCloseMemHandle(device_ptr)


def _step(cp, x, weights) -> None:
    """One prefill-shaped step: every layer's up and down projections."""
    h = x
    for up, down in weights:
        h = (h @ up) @ down


def _launch_bound_step(cp, small) -> None:
    """A step bound by its launches (a decode step without a graph): many tiny kernels."""
    for _ in range(LAUNCHES):
        small += 1.0


def _time_steps(cp, fn, reps: int) -> tuple[float, float]:
    """(median device ms by CUDA events, median wall ms) of ``fn`` over ``reps`` runs."""
    dev, wall = [], []
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(reps):
        t = time.perf_counter()
        start.record()
        fn()
        end.record()
        end.synchronize()
        wall.append(1e3 * (time.perf_counter() - t))
        dev.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(dev), statistics.median(wall)


def _busy_python(stop) -> None:
    while not stop.is_set():
        sum(range(1000))


def run(tokens: int, layers: int, reps: int, piece_mb: float) -> dict:
    import cupy as cp
    rng = cp.random.default_rng(0)
    x = rng.standard_normal((tokens, HIDDEN), dtype=cp.float32).astype(cp.float16)
    weights = [(rng.standard_normal((HIDDEN, FFN), dtype=cp.float32).astype(cp.float16) * 0.01,
                rng.standard_normal((FFN, HIDDEN), dtype=cp.float32).astype(cp.float16) * 0.01)
               for _ in range(layers)]
    small = cp.zeros(16, dtype=cp.float32)
    source = cp.cuda.alloc(SOURCE_BYTES)
    piece = min(SOURCE_BYTES, max(4096, int(piece_mb * (1 << 20))))
    handle = cp.cuda.runtime.ipcGetMemHandle(source.ptr)
    host = cp.cuda.alloc_pinned_memory(SOURCE_BYTES)
    ctx = mp.get_context("spawn")
    for _ in range(3):  # warm-up: cuBLAS plans, the pool
        _step(cp, x, weights)
        _launch_bound_step(cp, small)
    cp.cuda.Device().synchronize()
    rows: dict[str, dict] = {}
    for case in CASES:
        stop_t, counter, worker, proc = threading.Event(), [0], None, None
        stop_p, started, result = ctx.Event(), ctx.Event(), ctx.Value("d", 0.0)
        if case == "d2h-thread":
            worker = threading.Thread(target=_copy_loop, daemon=True, args=(
                cp, source.ptr, host.ptr, piece, True, stop_t, counter))
        elif case == "python-thread":
            worker = threading.Thread(target=_busy_python, args=(stop_t,), daemon=True)
        elif case in ("d2h-process", "h2d-process"):
            proc = ctx.Process(target=_copier_process, args=(
                handle, piece, case == "d2h-process", started, stop_p, result))
            proc.start()
            if not started.wait(120):
                raise RuntimeError(f"{case}: the copier process did not start")
        if worker is not None:
            worker.start()
        time.sleep(0.2)  # the copies are flowing
        began, copied_before = time.perf_counter(), counter[0]
        dev_ms, wall_ms = _time_steps(cp, lambda: _step(cp, x, weights), reps)
        launch_dev, launch_wall = _time_steps(cp, lambda: _launch_bound_step(cp, small), reps)
        elapsed = time.perf_counter() - began
        stop_t.set()
        stop_p.set()
        if worker is not None:
            worker.join(30)
        gbps = (counter[0] - copied_before) / elapsed / 1e9 if case == "d2h-thread" else None
        if proc is not None:
            proc.join(60)
            gbps = result.value / 1e9
        print(f"{case:>14}: step {dev_ms:8.3f} ms, launch-bound {launch_wall:8.3f} ms, "
              f"copy {gbps} GB/s", flush=True)
        rows[case] = {"step_ms": round(dev_ms, 3), "step_wall_ms": round(wall_ms, 3),
                      "launch_bound_wall_ms": round(launch_wall, 3),
                      "copy_gbps": round(gbps, 2) if gbps is not None else None}
    base = rows["none"]
    for row in rows.values():
        row["step_ratio"] = round(row["step_ms"] / base["step_ms"], 4)
        row["launch_bound_ratio"] = round(
            row["launch_bound_wall_ms"] / base["launch_bound_wall_ms"], 4)
    return {"tokens": tokens, "layers": layers, "reps": reps, "piece_bytes": piece,
            "source_bytes": SOURCE_BYTES, "cases": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--block-mb", type=float, default=2.25, help="one copy's size (MiB)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        fields = run(args.tokens, args.layers, args.reps, args.block_mb)
    finally:
        sys.setswitchinterval(before)
    for case, row in fields["cases"].items():
        print(f"{case:>14}: step {row['step_ms']:8.3f} ms ({row['step_ratio']:.3f}x)  "
              f"launch-bound {row['launch_bound_wall_ms']:7.3f} ms "
              f"({row['launch_bound_ratio']:.3f}x)  copy {row['copy_gbps']} GB/s")
    finish("copy_contention", fields, args.out, argv if argv is not None else sys.argv[1:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
