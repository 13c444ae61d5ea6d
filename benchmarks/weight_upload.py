"""A checkpoint's upload to the GPU through ``PinnedUpload``, by staging-buffer size.

A start plans the upload (allocates each device array: ``plan``), then page-locks the two
staging buffers (paid again by every process) and streams the checkpoint through them on the
upload's thread (``upload``, the pinning included). Larger buffers pin longer; smaller ones may
upload slower. Each size runs in a fresh process (CuPy's pinned pool would hand a second run the
first one's pages), ``--reps`` times, interleaved; reported per size: plan ms, upload ms and
GB/s, their total, medians, and the total against the largest size's in the same run.

    python -m benchmarks.weight_upload --model DIR [--buffer-mib 256,128,64,32] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from benchmarks.common import command, machine_info, now_iso, today, write_result
from kvstore.cli.args import positive_int_arg


def _sizes_arg(text: str) -> list[int]:
    """argparse type: comma-separated positive sizes in MiB."""
    return [positive_int_arg(part) for part in text.split(",")]


def _child(model_dir: str, buffer_mib: int) -> dict:
    """One upload of the whole checkpoint in this process; its timings."""
    import cupy as cp

    from engine.weights import CheckpointReader
    from kernels.pinned_upload import PinnedUpload

    reader = CheckpointReader(model_dir)
    cp.cuda.Device().synchronize()  # the context exists before the clock starts
    start = time.perf_counter()
    upload = PinnedUpload(buffer_bytes=buffer_mib << 20)
    arrays, total = [], 0
    for name in reader.names():  # the bytes as stored: a transfer, whatever their dtype
        raw, _ = reader.read(name)
        arrays.append(upload.upload(raw))
        total += raw.nbytes
    planned = time.perf_counter()  # the pinning and copies run from here
    upload.finish()
    done = time.perf_counter()
    return {"buffer_mib": buffer_mib, "bytes": total, "plan_ms": 1e3 * (planned - start),
            "upload_ms": 1e3 * (done - planned), "total_ms": 1e3 * (done - start),
            "upload_gbps": total / (done - planned) / 1e9}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a checkpoint folder")
    parser.add_argument("--buffer-mib", type=_sizes_arg, default="256,128,64,32",
                        help="comma-separated staging buffer sizes in MiB")
    parser.add_argument("--reps", type=positive_int_arg, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = args.buffer_mib
    if args.child:
        print(json.dumps(_child(args.model, sizes[0])), flush=True)
        return 0
    runs: list[dict] = []
    for rep in range(args.reps):
        for mib in sizes:
            done = subprocess.run([sys.executable, "-m", "benchmarks.weight_upload", "--child",
                                   "--model", args.model, "--buffer-mib", str(mib)],
                                  capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"the {mib} MiB run failed:\n{done.stderr[-2000:]}")
            run = json.loads(done.stdout.strip().splitlines()[-1])
            runs.append({"rep": rep, **run})
            print(f"rep {rep} 2 x {mib:4d} MiB: plan {run['plan_ms']:6.1f} ms, upload "
                  f"{run['upload_ms']:7.1f} ms ({run['upload_gbps']:5.2f} GB/s), total "
                  f"{run['total_ms']:7.1f} ms", flush=True)
    medians = {}
    for mib in sizes:
        mine = [r for r in runs if r["buffer_mib"] == mib]
        medians[mib] = {key: statistics.median(r[key] for r in mine)
                        for key in ("plan_ms", "upload_ms", "total_ms", "upload_gbps")}
    largest = medians[max(sizes)]["total_ms"]
    for mib in sizes:
        medians[mib]["total_vs_largest"] = medians[mib]["total_ms"] / largest
        print(f"median 2 x {mib:4d} MiB: plan {medians[mib]['plan_ms']:6.1f} ms, upload "
              f"{medians[mib]['upload_gbps']:5.2f} GB/s, total {medians[mib]['total_ms']:7.1f} "
              f"ms = {medians[mib]['total_vs_largest']:.3f} of {max(sizes)} MiB's")
    result = {"benchmark": "weight_upload", "model": args.model, "machine": machine_info(),
              "date": now_iso(), "command": command("python -m benchmarks.weight_upload", argv),
              "runs": runs, "median_by_buffer_mib": {str(k): v for k, v in medians.items()}}
    path = write_result(args.out, f"weight-upload-{today()}.json", result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
