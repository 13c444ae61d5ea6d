"""What every benchmark shares: machine info, timers, and writing a result file.

A result is one JSON file in ``benchmarks/results/`` (or ``--out``) carrying the machine, the date
and the command that made it, so any number in the README can be traced to a run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any


def machine_info() -> dict:
    """Node, CPU, core count, Python version and the first GPU's name (None without one)."""
    info = {"node": platform.node(), "cpu": platform.processor() or platform.machine(),
            "num_cpus": os.cpu_count(), "python": platform.python_version()}
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
            info["gpu"] = out.splitlines()[0] if out else None
        except (OSError, subprocess.SubprocessError):
            info["gpu"] = None
    return info


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median wall-clock milliseconds of ``fn()`` over ``reps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cuda_median_ms(cp: Any, fn: Callable[[], object], reps: int, stream: Any = None) -> float:
    """Median device milliseconds of ``fn()`` by CUDA events on ``stream`` (None: the current
    stream), after one warm-up call."""
    fn()
    if stream is None:
        cp.cuda.Device().synchronize()
    else:
        stream.synchronize()
    times = []
    for _ in range(reps):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        if stream is None:
            start.record()
        else:
            start.record(stream)
        fn()
        if stream is None:
            stop.record()
        else:
            stop.record(stream)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(statistics.median(times))


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def now_iso(utc: bool = False) -> str:
    """The time now to the second, ISO 8601 (local, or UTC with its offset)."""
    now = datetime.datetime.now(datetime.timezone.utc) if utc else datetime.datetime.now()
    return now.isoformat(timespec="seconds")


def today() -> str:
    """Today's date (YYYY-MM-DD): the stamp in result file names."""
    return datetime.date.today().isoformat()


def command(prefix: str, argv: Sequence[str] | None) -> str:
    """The command line that made a result: ``prefix`` and the arguments (``sys.argv``'s when
    ``argv`` is None)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join([prefix, *args])


def write_result(out_dir: str | Path, name: str, result: dict, indent: int = 2,
                 default: Callable[[Any], Any] | None = None) -> Path:
    """Write ``result`` as ``out_dir/name`` (JSON, the folder made if missing); returns the
    path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(result, indent=indent, default=default) + "\n")
    return path


def finish(benchmark: str, fields: dict, out_dir: str | Path, argv: Sequence[str] | None,
           name: str | None = None, machine: dict | None = None) -> Path:
    """Write benchmark ``benchmark``'s result (``fields`` with the machine, the date and the
    command ``python -m benchmarks.<benchmark>`` that made it) into ``out_dir`` as ``name``
    (default ``<benchmark, dashed>-<today>.json``); prints and returns its path."""
    result = {"benchmark": benchmark, **fields, "machine": machine or machine_info(),
              "date": now_iso(), "command": command(f"python -m benchmarks.{benchmark}", argv)}
    path = write_result(out_dir, name or f"{benchmark.replace('_', '-')}-{today()}.json", result)
    print(f"wrote {path}")
    return path


def raw_h2d_gbps(num_bytes: int, device: str) -> float | None:
    """GB/s of one pinned host-to-device cudaMemcpyAsync of ``num_bytes`` (median of 4 after a
    warm-up, CUDA events); None off CUDA."""
    if device != "cuda":
        return None
    import cupy as cp

    host = cp.cuda.alloc_pinned_memory(num_bytes)
    dev = cp.cuda.alloc(num_bytes)
    stream = cp.cuda.Stream(non_blocking=True)
    times = []
    for _ in range(5):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        cp.cuda.runtime.memcpyAsync(dev.ptr, host.ptr, num_bytes, 1, stream.ptr)
        stop.record(stream)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return num_bytes / statistics.median(times[1:]) / 1e6


def names_arg(known: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names, each one of ``known``."""
    known = list(known)

    def parse(text: str) -> list[str]:
        names = text.split(",")
        unknown = [n for n in names if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown variant(s) {', '.join(unknown)}; known: "
                                             + ", ".join(known))
        return names

    return parse
