"""Short prefill queries over long paged contexts (a chat turn's last tokens over its cached
history): one Qwen3-4B layer's attention, replayed from CUDA graphs (device time, no launch gaps),
three ways in one run: cuDNN split over the context (``kernels/cudnn_split.py``) at several slice
counts, with its own kernels timed alone (query copies, merge); cuDNN as one paged call; our
kernel (``attention.cu``, which splits the context its own way). Each is checked against the
one-call cuDNN output (relative error). Writes JSON to benchmarks/results/.

    python -m benchmarks.split_attention [--contexts 4096,16384] [--rows 16,40,256]
        [--slices 8,16,32,64] [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from benchmarks.common import command, machine_info, now_iso, today, write_result

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 32, 8, 128, 16, 4


def _replayed_ms(cp, capturer, fn, reps: int) -> float:
    """Median device ms of one call of ``fn`` (each layer once), replayed from a graph."""
    graph = capturer.capture(fn)
    graph.replay()
    times = []
    for _ in range(reps):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return statistics.median(times) / NUM_LAYERS


def bench_case(cp, bf16, attn, capturer, context_len: int, q_len: int, slices: list[int],
               reps: int) -> dict:
    from kernels import attention
    from kernels import split_prefill as sp

    rng = np.random.default_rng(0)
    num_blocks = -(-context_len // BLOCK_SIZE)
    kv = cp.random.standard_normal((num_blocks + 8, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS,
                                    HEAD_DIM), dtype=cp.float32).astype(bf16)
    table = cp.asarray(rng.permutation(num_blocks + 8)[:num_blocks].astype(np.int32)[None])
    cu = cp.asarray(np.array([0, q_len], np.int32))
    ctx = cp.asarray(np.array([context_len], np.int32))
    q = cp.random.standard_normal((q_len, NUM_Q_HEADS, HEAD_DIM), dtype=cp.float32).astype(bf16)
    scale = HEAD_DIM ** -0.5

    def cudnn_layers():
        return [attn.run_prefill(q, kv, layer, table, cu, ctx, scale, q_len)
                for layer in range(NUM_LAYERS)][-1]

    def ours_layers():
        return [attention.paged_attention_prefill(q, kv, layer, table, cu, ctx, scale)
                for layer in range(NUM_LAYERS)][-1]

    split = attn.split
    attn.split = None
    row = {"context_tokens": context_len, "query_rows": q_len,
           "cudnn_whole_ms": _replayed_ms(cp, capturer, cudnn_layers, reps)}
    whole = cudnn_layers().astype(cp.float32)
    attn.split = split

    def rel(out) -> float:
        return float(cp.linalg.norm(out.astype(cp.float32) - whole) / cp.linalg.norm(whole))

    row["ours_ms"] = _replayed_ms(cp, capturer, ours_layers, reps)
    row["ours_rel_err"] = rel(ours_layers())
    for num_slices in slices:
        split.num_slices = num_slices
        row[f"split_{num_slices}_ms"] = _replayed_ms(cp, capturer, cudnn_layers, reps)
        row[f"split_{num_slices}_rel_err"] = rel(cudnn_layers())
    split.num_slices = None  # the default rule
    row["split_default_ms"] = _replayed_ms(cp, capturer, cudnn_layers, reps)
    out = cudnn_layers()
    step = split._step  # the buffers of the run just made (this benchmark looks inside)
    used = step.config[0]

    def copies():
        for _ in range(NUM_LAYERS):
            sp.replicate_q(q, cu, step.q_lens, step.q_rep, used)
        return step.q_rep

    def merges():
        for _ in range(NUM_LAYERS):
            sp.merge_partials(step.o_part, step.lse, cu, step.kv_lens, out, used)
        return out

    row["default_slices"] = used
    row["replicate_q_ms"] = _replayed_ms(cp, capturer, copies, reps)
    row["merge_ms"] = _replayed_ms(cp, capturer, merges, reps)
    kv_bytes = context_len * NUM_KV_HEADS * HEAD_DIM * 2 * 2
    row["kv_read_floor_ms_at_3tbps"] = kv_bytes / 3.0e9
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="4096,16384")
    p.add_argument("--rows", default="16,40,256")
    p.add_argument("--slices", default="8,16,32,64")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--name", default="")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)

    import cupy as cp
    import ml_dtypes

    from kernels.cuda_graph import GraphCapturer
    from kernels.cudnn_attention import CudnnAttention

    attn, capturer = CudnnAttention(), GraphCapturer()
    slices = [int(x) for x in args.slices.split(",")]
    rows = []
    for context_len in (int(x) for x in args.contexts.split(",")):
        for q_len in (int(x) for x in args.rows.split(",")):
            row = bench_case(cp, ml_dtypes.bfloat16, attn, capturer, context_len + q_len, q_len,
                             slices, args.reps)
            rows.append(row)
            print(" ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in row.items()), flush=True)
    result = {"benchmark": "split_attention", "rows": rows, "cudnn": attn.version,
              "refusals": {str(k): v for k, v in attn.refusals.items()},
              "machine": machine_info(), "date": now_iso(),
              "command": command("python -m benchmarks.split_attention", argv)}
    path = write_result(args.out, f"split_attention-{args.name or today()}.json", result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
