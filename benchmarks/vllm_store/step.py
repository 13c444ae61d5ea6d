"""A vLLM-shaped prefill step with the connector's saves on against off, in one run (issue 29).

Each step does what a vLLM worker does for one 2,048-token chunk of a Qwen3-4B-shaped model:
the chunk's GEMMs on torch (36 layers of QKV, output, gate/up and down projections, bf16, one
layer's weights reused) and its KV written into ``--layers`` vLLM flash-layout tensors
(``[2, num_blocks, 16, 8, 128]``, 128 fresh blocks a step), then the connector's worker calls in
vLLM's order: ``pump_saves`` (``start_load_kv``, before the forward), the forward, ``save`` with
an event recorded behind the forward (``wait_for_save``), ``poll`` and ``finished_saving``
(``get_finished``); the step ends when the host has the step's result (a synchronize, as vLLM
reads its sampled tokens: the compute stream's synchronize). "off" runs the same steps without
the connector. The saves are real: a ``kvstore serve`` copies each step's ~300 MB of blocks over
CUDA IPC into its DRAM while the next steps compute. ``engine`` (the issue's other candidate,
measured for its cost to the step): the engine copies the same blocks itself, on a side stream of
its own process behind the step's event, gathered per layer into pinned host memory (no daemon,
no bookkeeping: the copy alone). Reported: step time p50 and mean per mode against off (off
measured before and after, to see drift), how many blocks the store saved, and the engine-side
copy's bandwidth.

``--daemon-variants``: the daemon started with other ``kvstore serve --copy-*`` options, each
measured as its own mode (``daemon`` is the shipped default, whose saves stay on the copy
engines: vLLM's 32 KiB pieces in one driver batch): ``save_kernels`` lets saves pack on the GPU
as loads do (the default before 2026-11-29), ``dma_only`` also keeps loads off kernels,
``memcpy_small`` a ``cudaMemcpyAsync`` per piece, ``staged`` the default daemon with the
connector's device staging (its default room of 128 slots, 64 for saves, or ``--staging-blocks``
slots: the worker packs each save's pieces into
whole blocks on a stream of its own behind the step, in at most 128 CTAs; ``staged_narrow``:
32), and the daemon moves whole blocks). A daemon's
kernels run in their own CUDA context, which the GPU time-slices against the step's; copy
engines work beside it.

    python -m benchmarks.vllm_store.step [--steps 30] [--warmup 5] [--tokens 2048] [--out DIR]
                                   [--modes daemon,engine] [--daemon-variants default,save_kernels]
"""

from __future__ import annotations

import argparse
import itertools
import platform
import random
import time

import numpy as np

from benchmarks.common import command, names_arg, now_iso, today, write_result
from benchmarks.vllm_store.store_process import start_store, stop_store
from offload.external.block_keys import KeyMaker
from offload.external.device_staging import PACK_CTAS, packing_unavailable
from offload.external.plan import BlockTransfer, StepPlan
from offload.external.worker_side import WorkerSide
from offload.vllm.model_identity import vllm_identity
from offload.vllm.settings import ConnectorSettings
from offload.vllm.staging_room import StagingRoom

HIDDEN, INTERMEDIATE, Q_DIM, KV_DIM = 2560, 9728, 4096, 1024  # Qwen3-4B
# Daemon variants: the `kvstore serve` options each starts its daemon with ([] = as shipped).
_NEVER_PACKED = ["--copy-packed-min-pieces", "1000000"]
DAEMON_VARIANTS = {"default": [], "save_kernels": ["--copy-save-kernels"],
                   "dma_only": [*_NEVER_PACKED, "--copy-small-runs", "batch"],
                   "memcpy_small": [*_NEVER_PACKED, "--copy-small-runs", "memcpy"],
                   "staged": [], "staged_narrow": []}
# Variants whose connector packs through device staging (``--staging-blocks`` slots), and the
# CTAs its saves' packing may use (None: the connector's default, ``PACK_CTAS``).
STAGED_VARIANTS = {"staged": None, "staged_narrow": 32}


class Step:
    """One chunk's compute and KV writes on the GPU (torch), without the connector."""

    def __init__(self, torch, tokens: int, layers: int, kv: list, block_size: int) -> None:
        dev, bf16 = "cuda", torch.bfloat16
        self.torch = torch
        self.x = torch.randn(tokens, HIDDEN, device=dev, dtype=bf16)
        self.w_qkv = torch.randn(HIDDEN, Q_DIM + 2 * KV_DIM, device=dev, dtype=bf16) * 0.02
        self.w_o = torch.randn(Q_DIM, HIDDEN, device=dev, dtype=bf16) * 0.02
        self.w_up = torch.randn(HIDDEN, 2 * INTERMEDIATE, device=dev, dtype=bf16) * 0.02
        self.w_down = torch.randn(INTERMEDIATE, HIDDEN, device=dev, dtype=bf16) * 0.02
        self.layers = layers
        self.kv = kv
        self.block_size = block_size
        self.num_blocks = tokens // block_size
        heads = kv[0].shape[3]
        self.new_kv = torch.randn(2, self.num_blocks, block_size, heads, KV_DIM // heads,
                                  device=dev, dtype=bf16)

    def run(self, block_ids: list[int]) -> None:
        torch = self.torch
        ids = torch.tensor(block_ids, device="cuda")
        h = self.x
        for layer in range(self.layers):
            qkv = h @ self.w_qkv
            h = h + qkv[:, :Q_DIM] @ self.w_o
            up = h @ self.w_up
            gated = torch.nn.functional.silu(up[:, :INTERMEDIATE]) * up[:, INTERMEDIATE:]
            h = h + gated @ self.w_down
            self.kv[layer].index_copy_(1, ids, self.new_kv)


class EngineCopies:
    """The engine copies a step's blocks to pinned host memory itself, on its own side stream."""

    def __init__(self, torch, kv: list, per_step: int) -> None:
        self.torch = torch
        self.kv = kv
        shape = (len(kv), 2, per_step, *kv[0].shape[2:])
        self.host = torch.empty(shape, dtype=kv[0].dtype, pin_memory=True)
        self.stream = torch.cuda.Stream()
        self.spans: list[tuple] = []  # (start, end) events of each step's copies

    def after_step(self, ids: list[int]) -> None:
        torch = self.torch
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream())
        index = torch.tensor(ids, device="cuda")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            start.record(self.stream)
            for layer, tensor in enumerate(self.kv):
                self.host[layer].copy_(tensor.index_select(1, index), non_blocking=True)
            end.record(self.stream)
        index.record_stream(self.stream)
        self.spans.append((start, end))

    def gbps(self, num_bytes: int) -> float:
        self.stream.synchronize()
        ms = [a.elapsed_time(b) for a, b in self.spans]
        return num_bytes / (float(np.median(ms)) / 1e3) / 1e9 if ms else 0.0


def _timed(torch, step: Step, pick, worker: WorkerSide | None, plan_for, n: int,
           engine: EngineCopies | None = None) -> list[float]:
    out = []
    compute = torch.cuda.current_stream()
    for i in range(n):
        ids = pick(i)
        t0 = time.perf_counter()
        if worker is not None:
            worker.pump_saves()  # start_load_kv
        step.run(ids)
        if worker is not None:
            event = torch.cuda.Event()
            event.record(compute)
            worker.save(plan_for(i, ids), event.query)  # wait_for_save
            worker.poll()  # get_finished
            worker.finished_saving(())
        if engine is not None:
            engine.after_step(ids)
        compute.synchronize()  # the step's sampled tokens reach the host
        out.append(time.perf_counter() - t0)
    return out


def _daemon_mode(torch, step: Step, pick, plan_for, kv: list, args: argparse.Namespace,
                 variant: str, step_bytes: int) -> tuple[list[float], tuple[int, int]]:
    """Step times with the connector saving through a daemon started as ``variant``, and the
    blocks it saved and failed; ``step_bytes``: what one step saves."""
    dram = int(step_bytes * (args.warmup + args.steps) * 1.1) + (1 << 30)
    proc, socket_path = start_store(str(dram), flags=DAEMON_VARIANTS[variant])
    try:
        # The connector's room: by default 128 slots, 64 for saves (requests of 32 blocks: a
        # step's saves beyond two requests wait for room)
        room = StagingRoom.of(ConnectorSettings(
            device_staging_blocks=args.staging_blocks if variant in STAGED_VARIANTS else 0),
            True, True, True, step_bytes // max(1, step.num_blocks), packing_unavailable)
        if variant in STAGED_VARIANTS and not room.device_slots:
            raise RuntimeError(f"{variant}: {room.note}")  # never a staged row measured unstaged
        mover = room.mover([f"l{i}" for i in range(args.layers)], kv, kv[0].shape[1], {},
                           pack_ctas=STAGED_VARIANTS.get(variant) or PACK_CTAS)
        worker = WorkerSide(socket_path, mover, "vllm-step-bench", 120.0, 120.0,
                            retry_interval_s=1.0)
        if not worker.connect(wait_s=60.0):
            raise RuntimeError("could not register the CUDA tensors with the daemon")
        _timed(torch, step, pick, worker, plan_for, args.warmup)
        times = _timed(torch, step, pick, worker, plan_for, args.steps)
        worker.drain(120.0)
        saved = worker.counters["blocks_saved"]
        failed = sum(n for name, n in worker.counters.items()
                     if name == "blocks_save_failed" or name.startswith("blocks_save_dropped")
                     or name.startswith("blocks_save_skipped"))
        print(f"  {variant}: {worker.counters['saves']} save requests, "
              f"{worker.counters['saves_waited_for_room']} waited for staging room", flush=True)
        worker.close()
        return times, (saved, failed)
    finally:
        stop_store(proc, socket_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--modes", default="daemon,engine",
                        help="daemon (the connector's saves), engine (the engine's own copies)")
    parser.add_argument("--staging-blocks", type=int, default=None,
                        help="device staging slots of the staged variants (default: the "
                             "connector's, load_blocks + save_blocks)")
    parser.add_argument("--daemon-variants", default="default",
                        type=names_arg(DAEMON_VARIANTS),
                        help="comma-separated: " + ", ".join(DAEMON_VARIANTS))
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"daemon", "engine"}:
        parser.error("--modes: daemon, engine or both")
    import torch

    bs, heads, head_dim = 16, 8, 128
    per_step = args.tokens // bs
    num_blocks = per_step * 4  # steps cycle through four sets of blocks
    kv = [torch.zeros(2, num_blocks, bs, heads, head_dim, device="cuda", dtype=torch.bfloat16)
          for _ in range(args.layers)]
    step = Step(torch, args.tokens, args.layers, kv, bs)
    torch.cuda.synchronize()
    block_bytes = args.layers * 2 * bs * heads * head_dim * 2
    model = vllm_identity("Qwen3ForCausalLM", args.layers, heads, head_dim, "bfloat16", bs,
                          "bench-step", "cuda:bench")
    keys = KeyMaker(model)

    def pick(i: int) -> list[int]:
        base = (i % 4) * per_step
        return random.Random(i).sample(range(base, base + per_step), per_step)

    total = args.warmup + args.steps
    seeds = itertools.count(10_000)

    def plan_for(i: int, ids: list[int]) -> StepPlan:
        rng = random.Random(next(seeds))  # fresh keys every step: saved, never "duplicate"
        k = keys.keys([rng.randrange(10, 150_000) for _ in range(per_step * bs)])
        return StepPlan(saves=[BlockTransfer(f"r{i}", ids, k.namespace, k.hashes, k.idents)])

    _timed(torch, step, pick, None, plan_for, args.warmup)
    off_before = _timed(torch, step, pick, None, plan_for, args.steps)
    on: dict[str, list[float]] = {}
    saved = failed = 0
    engine_gbps = None
    if "daemon" in modes:
        for variant in args.daemon_variants:
            mode = "daemon" if variant == "default" else f"daemon_{variant}"
            on[mode], counts = _daemon_mode(torch, step, pick, plan_for, kv, args, variant,
                                            per_step * block_bytes)
            saved, failed = saved + counts[0], failed + counts[1]
    if "engine" in modes:
        copies = EngineCopies(torch, kv, per_step)
        _timed(torch, step, pick, None, plan_for, args.warmup, copies)
        copies.spans.clear()
        on["engine"] = _timed(torch, step, pick, None, plan_for, args.steps, copies)
        engine_gbps = copies.gbps(per_step * block_bytes)
    off_after = _timed(torch, step, pick, None, plan_for, args.steps)
    off = off_before + off_after

    def stats(xs: list[float]) -> dict:
        return {"p50_ms": float(np.median(xs)) * 1e3, "mean_ms": float(np.mean(xs)) * 1e3}

    result = {"benchmark": "vllm_step", "date": now_iso(), "device": torch.cuda.get_device_name(),
              "host": platform.node(), "tokens_per_step": args.tokens, "layers": args.layers,
              "blocks_per_step": per_step, "bytes_saved_per_step": per_step * block_bytes,
              "steps": args.steps, "off": stats(off), "off_before": stats(off_before),
              "off_after": stats(off_after), "blocks_saved": saved,
              "blocks_expected": per_step * total * len(args.daemon_variants)
              if "daemon" in modes else 0, "daemon_variants": args.daemon_variants,
              "blocks_failed": failed, "engine_copy_gbps": engine_gbps,
              "command": command("python -m benchmarks.vllm_store.step", argv)}
    print(f"step p50 off {result['off']['p50_ms']:.2f} ms (before "
          f"{result['off_before']['p50_ms']:.2f}, after {result['off_after']['p50_ms']:.2f})",
          flush=True)
    for mode, xs in on.items():
        result[mode] = stats(xs)
        result[f"{mode}_vs_off_p50"] = result[mode]["p50_ms"] / result["off"]["p50_ms"]
        result[f"{mode}_vs_off_mean"] = result[mode]["mean_ms"] / result["off"]["mean_ms"]
        print(f"  {mode:>6}: p50 {result[mode]['p50_ms']:.2f} ms, "
              f"{result[f'{mode}_vs_off_p50']:.3f}x off; mean {result[f'{mode}_vs_off_mean']:.3f}x",
              flush=True)
    if "daemon" in modes:
        print(f"  daemons saved {saved}/{result['blocks_expected']} blocks ({failed} failed)",
              flush=True)
    if engine_gbps is not None:
        print(f"  engine copy: {engine_gbps:.1f} GB/s a step's blocks (median)", flush=True)
    tag = "h100" if "H100" in result["device"] else "h200" if "H200" in result["device"] else "gpu"
    print(f"wrote {write_result(args.out, f'vllm_step-{tag}-{today()}.json', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
