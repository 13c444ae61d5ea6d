"""The vLLM connector's GPU data path against raw pinned cudaMemcpy of the same bytes, one run.

vLLM's side is this process: ``--layers`` torch CUDA tensors in vLLM's flash-attention layout
``[2, num_blocks, block_size, kv_heads, head_dim]`` (Qwen3-4B shape by default: 36 layers,
8 KV heads, head_dim 128, bf16, vLLM's GPU block size 16: 2.36 MB a block, 72 regions of 32 KiB),
registered with a real ``kvstore serve`` through CUDA IPC by the connector's own core
(``offload.external.kv_tensors.make_mover``). For 64..1024 shuffled block ids it times, by wall
clock, what vLLM's worker waits for: a write-through save (``WorkerSide.save``, waited as the
connector waits for it) and a load (``WorkerSide.start`` + ``poll`` until the request finished:
the lease lookup and the copy). Raw: one ``copy_`` of the same number of bytes between a
contiguous CUDA tensor and pinned host memory (CUDA events). Ratios are connector over raw.

    python -m benchmarks.vllm_store.transfer [--blocks 64,128,256,512,1024] [--reps 5] [--out DIR]
                                       [--variants default,kernel]

Variants, each a daemon started with other ``kvstore serve --copy-*`` options: ``default`` (as
shipped: blocks packed on the GPU by ``copy_pieces`` from a table of block ids into a staging
buffer that crosses the bus a run per block or fewer), ``runs`` (the same staging, gathered by
``copy_runs`` from a run per piece), ``kernel`` (one ``copy_runs`` launch reading or writing the
mapped pinned pool directly), ``chunk64`` (the default with 64 MiB save chunks and staging
slots), ``load_save_ramp`` (loads chunked as saves are: 2, 4, 8 ... blocks up to 32 MiB, as
before s28) and
``staged`` (the default daemon, the connector's device staging: the worker packs the pieces into
whole blocks in its own device memory, in at most 128 CTAs, ``staged_narrow`` 32; the daemon
moves whole blocks).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import time
from pathlib import Path

import numpy as np

from benchmarks.common import command, names_arg
from benchmarks.vllm_store.store_process import start_store, stop_store
from kvstore import Client
from kvstore.cli.args import positive_int_arg
from offload.external.block_keys import KeyMaker
from offload.external.device_staging import PACK_CTAS, packing_unavailable
from offload.external.plan import BlockTransfer, StepPlan
from offload.external.worker_side import WorkerSide
from offload.vllm.model_identity import vllm_identity
from offload.vllm.settings import ConnectorSettings
from offload.vllm.staging_room import StagingRoom

# Daemon variants: the `kvstore serve` options each starts its daemon with ([] = as shipped).
_NEVER_PACKED = ["--copy-packed-min-pieces", str(1 << 30)]  # more pieces than any layout has
_VARIANTS = {"default": [],  # loads packed on the GPU, saves one driver batch of pieces
             "save_kernels": ["--copy-save-kernels"],  # saves packed too
             "kernel": ["--copy-small-runs", "kernel", *_NEVER_PACKED, "--copy-save-kernels"],
             "runs": _NEVER_PACKED,
             "chunk64": ["--copy-chunk-size", "64MiB", "--copy-staging-slot-size", "64MiB"],
             # loads chunked as saves are (2, 4, 8 ... blocks up to 32 MiB): before s28
             "load_save_ramp": ["--copy-load-growth", "2", "--copy-load-chunk-size", "32MiB"],
             "staged": [], "staged_narrow": []}
# Variants whose connector goes through device staging (the worker packs, the daemon moves
# whole blocks; room for one whole save and one whole load), and the CTAs a save's packing may
# use (None: the connector's default).
_STAGED = {"staged": None, "staged_narrow": 32}


def _raw_gbps(torch, nbytes: int, reps: int, device: str) -> tuple[float, float]:
    """(device->host, host->device) GB/s of one copy of ``nbytes`` (CPU: a plain memcpy): the
    fastest of ``reps`` (the hardware's figure: one slow rep, seen on an H100 at 604 MB, must not
    make the connector look faster than the bus)."""
    cuda = device == "cuda"
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    out = []
    for dst, src in ((host, dev), (dev, host)):
        times = []
        for rep in range(reps + 1):
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                dst.copy_(src)
                seconds = time.perf_counter() - t0
            if rep:
                times.append(seconds)
        out.append(nbytes / min(times) / 1e9)
    return out[0], out[1]


def _transfer(keys: KeyMaker, block_ids: list[int], seed: int) -> BlockTransfer:
    bs = keys.block_size
    rng = random.Random(seed)
    tokens = [rng.randrange(10, 150000) for _ in range(len(block_ids) * bs)]
    k = keys.keys(tokens)
    return BlockTransfer(f"r{seed}", block_ids, k.namespace, k.hashes, k.idents)


def _wait_load(worker: WorkerSide, request_id: str, timeout_s: float = 120.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    failed: set[int] = set()
    while time.monotonic() < deadline:
        done, bad = worker.poll()
        failed |= bad
        if request_id in done:
            return failed
        # Hand the GIL over: a spinning poll starves the client's reader thread for a whole
        # switch interval (5 ms) per reply, ~20 ms a load (measured 2026-11-25). vLLM polls
        # once per step, never in a tight loop.
        time.sleep(50e-6)
    raise RuntimeError(f"load of {request_id} did not finish in {timeout_s} s")


_SENT: list[tuple[str, float, list]] = []  # --trace: (verb, send epoch, [landed epoch])


def _trace_client_requests() -> None:
    """--trace: note when this process's client sends each save/load and when its reply
    lands (epoch seconds), to set against the daemon's timeline."""
    from kvstore.wire.client import Client as WireClient

    send = WireClient.request

    def request(self, verb, args=None, timeout_s=None, convert=None, fds=()):
        landed: list = []

        def noted(reply):
            landed.append(time.time())
            return convert(reply) if convert is not None else reply

        pending = send(self, verb, args, timeout_s, noted, fds)
        if verb in ("save", "load", "lookup_load"):
            _SENT.append((verb, time.time(), landed))
        return pending

    WireClient.request = request


def _print_overheads(variant: str, trace: str, client_epochs: list[dict]) -> None:
    """Median ms of each step of a save and a load outside the copies, per block count: the
    benchmark's call to the request's send (a load's includes its lookup), on to the daemon's
    event loop (``execute``), its worker (``call``), the copy (``copy``), back, the reply's
    landing in this process and the benchmark's wake-up. Matched in order per verb."""
    rows = [json.loads(line) for line in Path(trace).read_text().splitlines()]
    marks: dict[str, dict[str, list]] = {"save": {}, "load": {}}
    for r in rows:
        if r["way"] == "span":
            verb = "load" if r["verb"] == "lookup_load" else r["verb"]  # a load in one trip
            marks.setdefault(verb, {}).setdefault(r["name"], []).append((r["enter_epoch"],
                                                                         r["exit_epoch"]))
        else:
            marks[r["way"]].setdefault("copy", []).append((r["enter_epoch"], r["exit_epoch"]))
    for verb in ("save", "load"):
        sent = [(at, landed[0] if landed else float("nan")) for v, at, landed in _SENT
                if v == verb or verb == "load" and v == "lookup_load"]
        marks[verb]["wire"] = sent
    steps = ("bench>send", "send>loop", "loop>worker", "worker>copy", "copy", "copy>worker",
             "worker>loop", "loop>landed", "landed>bench")
    by_n: dict[tuple[int, str], list[list[float]]] = {}
    for verb in ("save", "load"):
        m = marks[verb]
        for i, rep in enumerate(client_epochs):
            try:
                (send, landed), (lo, li), (wo, wi), (co, ci) = (
                    m["wire"][i], m["execute"][i], m["call"][i], m["copy"][i])
            except (KeyError, IndexError):
                break
            b0, b1 = rep[verb]
            points = (b0, send, lo, wo, co, ci, wi, li, landed, b1)
            by_n.setdefault((rep["blocks"], verb), []).append(
                [(b - a) * 1e3 for a, b in zip(points, points[1:])])
    for (n, verb), reps in sorted(by_n.items()):
        med = np.median(np.array(reps), axis=0)
        print(f"{variant:>8} {n:5d} blocks {verb} ms: " + ", ".join(
            f"{k} {v:.2f}" for k, v in zip(steps, med)), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="64,128,256,512,1024")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--save-request-blocks", type=positive_int_arg, default=None,
                        help="blocks per save request (default: the mover's, as vLLM's worker)")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: the staged path with CPU tensors (a smoke run, not the target)")
    parser.add_argument("--variants", default="default", type=names_arg(_VARIANTS),
                        help="comma-separated daemon variants: " + ", ".join(_VARIANTS))
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--trace", action="store_true",
                        help="a timeline of every daemon save/load (benchmarks/copy_trace.py)")
    args = parser.parse_args(argv)
    import torch

    cuda = args.device == "cuda"
    if args.trace:
        _trace_client_requests()

    counts = [int(x) for x in args.blocks.split(",")]
    num_blocks = max(counts)
    shape = (2, num_blocks, args.block_size, args.kv_heads, args.head_dim)
    layers = [torch.randn(shape, device=args.device, dtype=torch.float32).to(torch.bfloat16)
              for _ in range(args.layers)]
    if cuda:
        torch.cuda.synchronize()
    block_bytes = args.layers * 2 * args.block_size * args.kv_heads * args.head_dim * 2
    model = vllm_identity("Qwen3ForCausalLM", args.layers, args.kv_heads, args.head_dim,
                          "bfloat16", args.block_size, "bench", "cuda:bench")
    keys = KeyMaker(model)
    dram = int(block_bytes * num_blocks * 1.25) + (256 << 20)
    rows, raws = [], {}
    for variant in args.variants:
        client_epochs: list[dict] = []  # per rep: (send, reply) epoch seconds, for --trace
        _SENT.clear()
        trace = Path(args.out).resolve() / f"vllm_transfer-trace-{variant}.jsonl"
        preamble = ""
        if args.trace:
            trace.parent.mkdir(parents=True, exist_ok=True)
            trace.unlink(missing_ok=True)
            preamble = f"import benchmarks.copy_trace as ct; ct.install({str(trace)!r})"
        proc, socket_path = start_store(str(dram), preamble=preamble, flags=_VARIANTS[variant])
        try:
            # Staging room for one whole save and one whole load, split as the connector splits
            # it (saves in requests of half the saves' room: one packs while one moves).
            room = StagingRoom.of(ConnectorSettings(
                load_blocks=num_blocks, save_blocks=num_blocks,
                device_staging_blocks=2 * num_blocks if variant in _STAGED else 0),
                True, True, cuda, block_bytes, packing_unavailable)
            mover = room.mover([f"l{i}" for i in range(args.layers)], layers, num_blocks, {},
                               pack_ctas=_STAGED.get(variant) or PACK_CTAS)
            if args.save_request_blocks is not None:
                mover.max_save_blocks = args.save_request_blocks
            worker = WorkerSide(socket_path, mover, "vllm-bench", 120.0, 120.0,
                                retry_interval_s=1.0)
            if not worker.connect(wait_s=60.0):
                raise RuntimeError("could not register the CUDA tensors with the daemon")
            for n in counts:
                save_s, load_s = [], []
                for rep in range(args.reps + 1):  # the first rep warms up
                    ids = random.Random(rep).sample(range(num_blocks), n)
                    t = _transfer(keys, ids, n * 1000 + rep)
                    before = worker.counters["blocks_saved"]
                    e0 = time.time()
                    t0 = time.perf_counter()
                    worker.save(StepPlan(saves=[t]))  # the worker cuts it as vLLM's would
                    worker.drain(120.0)  # CPU saves are not waited for by save() itself
                    t1 = time.perf_counter()
                    e1 = time.time()
                    if worker.counters["blocks_saved"] - before != n:
                        got = worker.counters["blocks_saved"] - before
                        raise RuntimeError(f"{n} blocks: saved {got}")
                    e2 = time.time()
                    t2 = time.perf_counter()
                    worker.start(StepPlan(loads=[t]))
                    failed = _wait_load(worker, t.request_id)
                    if cuda:  # a staged load is in the engine's blocks once its scatter ran
                        torch.cuda.current_stream().synchronize()
                    t3 = time.perf_counter()
                    client_epochs.append({"blocks": n, "save": (e0, e1), "load": (e2, time.time())})
                    if failed:
                        raise RuntimeError(f"{n} blocks: {len(failed)} failed to load")
                    with Client(socket_path) as client:  # free the DRAM for the next rep
                        client.remove(t.namespace, t.hashes)
                    if rep:
                        save_s.append(t1 - t0)
                        load_s.append(t3 - t2)
                if n not in raws:
                    raws[n] = _raw_gbps(torch, n * block_bytes, args.reps, args.device)
                raw_d2h, raw_h2d = raws[n]
                save_gbps = n * block_bytes / float(np.median(save_s)) / 1e9
                load_gbps = n * block_bytes / float(np.median(load_s)) / 1e9
                row = {"variant": variant, "blocks": n, "bytes": n * block_bytes,
                       "save_request_blocks": mover.max_save_blocks,
                       "save_gbps": save_gbps, "load_gbps": load_gbps,
                       "raw_d2h_gbps": raw_d2h, "raw_h2d_gbps": raw_h2d,
                       "save_vs_raw": save_gbps / raw_d2h, "load_vs_raw": load_gbps / raw_h2d,
                       "save_ms_median": float(np.median(save_s)) * 1e3,
                       "load_ms_median": float(np.median(load_s)) * 1e3}
                rows.append(row)
                print(f"{variant:>8} {n:5d} blocks: save {save_gbps:6.1f} GB/s "
                      f"({row['save_vs_raw']:.0%} of raw {raw_d2h:.1f}), load {load_gbps:6.1f} "
                      f"GB/s ({row['load_vs_raw']:.0%} of raw {raw_h2d:.1f})", flush=True)
            worker.close()
        finally:
            stop_store(proc, socket_path)
        if args.trace:
            from benchmarks.copy_trace import summarize

            _print_overheads(variant, str(trace), client_epochs)
            for row in summarize(str(trace)):
                print(f"{variant:>8} trace " + " ".join(
                    f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in row.items()), flush=True)
    device = torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor() or 'host'})"
    tag = "h200" if "H200" in device else "h100" if "H100" in device else args.device
    out = {"benchmark": "vllm_transfer", "date": datetime.date.today().isoformat(),
           "device": device, "host": platform.node(), "layout": "flash [2, B, N, H, D]",
           "path": "CUDA IPC, daemon copies" if cuda else "staged through shared memory",
           "layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
           "block_size": args.block_size, "block_bytes": block_bytes, "reps": args.reps,
           "rows": rows, "command": command("python -m benchmarks.vllm_store.transfer", argv)}
    path = Path(args.out) / f"vllm_transfer-{tag}-{out['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
