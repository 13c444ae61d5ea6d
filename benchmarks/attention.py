"""Attention of one layer (Qwen3-4B heads) three ways in one run: our kernels, cuDNN SDPA over
the paged arena, torch SDPA on contiguous tensors.

Prefill: one sequence of L tokens, causal, K/V read from the paged arena (block_size 16, shuffled
blocks) by ours and by cuDNN (page tables, ragged rows, bottom-right causal mask), against
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` (flash backend). Also a
prefix-hit shape: the last 512 tokens over a cached prefix of L - 512. Decode: one query per
sequence over a context of L, at each batch size, ours and cuDNN over the arena, SDPA with one
query. GPU times by CUDA events, median of --reps; decode also replayed from a CUDA graph of
--graph-calls calls (what the engine's decode graphs do: no Python launch gaps). cuDNN's output
is checked against ours (relative error), its graph build time is reported. Targets (issue 17):
prefill >= 90% of SDPA's throughput, decode >= 85% of SDPA's KV-read bandwidth. torch is used
here only as the baseline. Writes JSON to benchmarks/results/.

    python -m benchmarks.attention [--lengths 4096,16384] [--decode-batch 1,32,128] [--reps 20]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np

from benchmarks.common import command, cuda_median_ms, now_iso, today, write_result

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
PREFIX_HIT_QUERY = 512
PREFILL_GRAPH_CALLS = 5


def _graph_ms(cp, fn, reps: int, calls: int) -> float:
    """Per-call time of ``calls`` calls captured in one CUDA graph, median of ``reps`` replays."""
    from kernels.cuda_graph import GraphCapturer

    graph = GraphCapturer().capture(lambda: [fn() for _ in range(calls)][-1])
    return cuda_median_ms(cp, graph.replay, reps) / calls


def _torch_graph_ms(cp, torch, fn, reps: int, calls: int) -> float:
    """Per-call time of ``calls`` torch calls captured in one CUDA graph (torch's own capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_median_ms(cp, graph.replay, reps) / calls


def _random_bf16(cp, bf16, shape: tuple[int, ...]):
    """N(0, 1) values made on the GPU, truncated to bf16 (the top half of each float32)."""
    bits = cp.random.standard_normal(shape, dtype=cp.float32).view(cp.uint32) >> 16
    return bits.astype(cp.uint16).view(bf16)


def _arena(cp, bf16, rng, num_seqs: int, context_len: int):
    blocks_per_seq = -(-context_len // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    kv = _random_bf16(cp, bf16, (num_blocks, 1, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM))
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(num_seqs, blocks_per_seq)
    return kv, cp.asarray(tables)


def _rel_err(cp, got, want) -> float:
    got, want = got.astype(cp.float32), want.astype(cp.float32)
    return float(cp.linalg.norm(got - want) / cp.linalg.norm(want))


def _bench_prefill(cp, bf16, torch, rng, cudnn_attn, length: int, q_len: int, reps: int):
    from kernels.attention import paged_attention_prefill

    scale = HEAD_DIM**-0.5
    kv, tables = _arena(cp, bf16, rng, 1, length)
    q = _random_bf16(cp, bf16, (q_len, NUM_Q_HEADS, HEAD_DIM))
    cu = cp.asarray(np.array([0, q_len], dtype=np.int32))
    ctx = cp.asarray(np.array([length], dtype=np.int32))
    args = (q, kv, 0, tables, cu, ctx, scale)
    ours_out = paged_attention_prefill(*args)
    row: dict = {"ours_ms": cuda_median_ms(cp, lambda: paged_attention_prefill(*args), reps),
                 "ours_graph_ms": _graph_ms(cp, lambda: paged_attention_prefill(*args), reps,
                                            PREFILL_GRAPH_CALLS)}
    # cuDNN three ways: K/V gathered dense and one sequence at its exact sizes (the host knows
    # its context; off in the engine until verified), gathered dense with a padding mask (the
    # engine's path for long queries), and read through the page tables in place
    for name, gather, context in (("cudnn_exact", True, length), ("cudnn", True, None),
                                  ("cudnn_paged", False, None)):
        if cudnn_attn is None:
            break
        cudnn_attn.gather = cudnn_attn.exact = gather

        def run(context=context):
            return cudnn_attn.run_prefill(*args, q_len, context)

        start = time.perf_counter()
        out = run()
        cp.cuda.Device().synchronize()
        row[f"{name}_first_call_ms"] = (time.perf_counter() - start) * 1e3  # graph build
        if out is None:
            row[f"{name}_refused"] = list(cudnn_attn.refusals.values())[-1]
            continue
        row[f"{name}_rel_err_vs_ours"] = _rel_err(cp, out, ours_out)
        row[f"{name}_ms"] = cuda_median_ms(cp, run, reps)
        row[f"{name}_graph_ms"] = _graph_ms(cp, run, reps, PREFILL_GRAPH_CALLS)
    if cudnn_attn is not None:
        cudnn_attn.exact = False
        row["cudnn_calls_by_path"] = {str(k): n for k, n in cudnn_attn.calls.items()}
    if cudnn_attn is not None:
        cudnn_attn.gather = True
        from kernels.gather_kv import gather_kv

        width = 1 << max(0, tables.shape[1] - 1).bit_length()
        padded = cp.zeros((1, width), dtype=cp.int32)
        padded[:, :tables.shape[1]] = tables
        # as the engine's dense path gathers: the context's blocks (and a margin), not the width
        row["gather_ms"] = cuda_median_ms(cp, lambda: gather_kv(kv, 0, padded, ctx), reps)
    F = torch.nn.functional
    tq = torch.randn(1, NUM_Q_HEADS, q_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    tk = torch.randn(1, NUM_KV_HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    tv = torch.randn_like(tk)
    # is_causal in torch is top-left aligned: only the full square (q_len == length) matches
    # the engine's mask; the prefix-hit shape times SDPA over all keys (an upper bound)
    def sdpa():
        return F.scaled_dot_product_attention(tq, tk, tv, is_causal=q_len == length,
                                              enable_gqa=True)

    row["sdpa_ms"] = cuda_median_ms(cp, sdpa, reps)
    row["sdpa_graph_ms"] = _torch_graph_ms(cp, torch, sdpa, reps, PREFILL_GRAPH_CALLS)
    keys = length * q_len - q_len * (q_len - 1) / 2  # (query, key) pairs under the mask
    flops = 4 * keys * NUM_Q_HEADS * HEAD_DIM
    return _ratios(row, flops, "tflops", 1e9, "throughput")


def _ratios(row: dict, work: float, unit: str, per_ms: float, what: str) -> dict:
    """Rates of every timed variant; each implementation's best time (eager or graph) over
    SDPA's best, and eager over eager."""
    for key in [k for k in row if k.endswith("_ms") and "first_call" not in k]:
        if not key.startswith("gather"):
            row[key[:-3] + "_" + unit] = work / row[key] / per_ms
    best_sdpa = min(row["sdpa_ms"], row["sdpa_graph_ms"])
    for name in ("ours", "cudnn", "cudnn_exact", "cudnn_paged"):
        if f"{name}_ms" in row:
            best = min(row[f"{name}_ms"], row.get(f"{name}_graph_ms", float("inf")))
            row[f"{name}_vs_sdpa_{what}"] = best_sdpa / best
            row[f"{name}_vs_sdpa_{what}_eager"] = row["sdpa_ms"] / row[f"{name}_ms"]
    return row


def _bench_decode(cp, bf16, torch, rng, cudnn_attn, length: int, num_seqs: int, args):
    from kernels.attention import paged_attention_decode

    scale = HEAD_DIM**-0.5
    kv, tables = _arena(cp, bf16, rng, num_seqs, length)
    q = _random_bf16(cp, bf16, (num_seqs, NUM_Q_HEADS, HEAD_DIM))
    ctx = cp.asarray(np.full(num_seqs, length, dtype=np.int32))
    call = (q, kv, 0, tables, ctx, scale)
    ours_out = paged_attention_decode(*call)
    row: dict = {"ours_ms": cuda_median_ms(cp, lambda: paged_attention_decode(*call), args.reps),
                 "ours_graph_ms": _graph_ms(cp, lambda: paged_attention_decode(*call),
                                            args.reps, args.graph_calls)}
    if cudnn_attn is not None:
        start = time.perf_counter()
        out = cudnn_attn.run_decode(*call)
        cp.cuda.Device().synchronize()
        row["cudnn_first_call_ms"] = (time.perf_counter() - start) * 1e3
        if out is None:
            row["cudnn_refused"] = list(cudnn_attn.refusals.values())[-1]
        else:
            row["cudnn_rel_err_vs_ours"] = _rel_err(cp, out, ours_out)
            row["cudnn_ms"] = cuda_median_ms(cp, lambda: cudnn_attn.run_decode(*call), args.reps)
            try:
                row["cudnn_graph_ms"] = _graph_ms(cp, lambda: cudnn_attn.run_decode(*call),
                                                  args.reps, args.graph_calls)
            except Exception as exc:  # capture refused: the engine could not graph it either
                row["cudnn_graph_error"] = f"{type(exc).__name__}: {exc}"
    F = torch.nn.functional
    tq = torch.randn(num_seqs, NUM_Q_HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    tk = torch.randn(num_seqs, NUM_KV_HEADS, length, HEAD_DIM, device="cuda",
                     dtype=torch.bfloat16)
    tv = torch.randn_like(tk)
    def sdpa():
        return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

    row["sdpa_ms"] = cuda_median_ms(cp, sdpa, args.reps)
    row["sdpa_graph_ms"] = _torch_graph_ms(cp, torch, sdpa, args.reps, args.graph_calls)
    kv_bytes = 2 * num_seqs * length * NUM_KV_HEADS * HEAD_DIM * 2
    return _ratios(row, kv_bytes, "kv_gbps", 1e6, "bandwidth")


def bench(args: argparse.Namespace) -> dict:
    import cupy as cp
    import ml_dtypes
    import torch

    from kernels.cudnn_attention import CudnnAttention, CudnnUnavailable

    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    result: dict = {"prefill": {}, "prefix_hit": {}, "decode": {}}
    try:
        cudnn_attn = CudnnAttention()
        result["cudnn"] = cudnn_attn.version
    except CudnnUnavailable as exc:
        cudnn_attn = None
        result["cudnn"] = f"unavailable: {exc}"
    for length in args.lengths:
        result["prefill"][str(length)] = _bench_prefill(cp, bf16, torch, rng, cudnn_attn, length,
                                                        length, args.reps)
        if length > PREFIX_HIT_QUERY:
            result["prefix_hit"][f"{PREFIX_HIT_QUERY}over{length}"] = _bench_prefill(
                cp, bf16, torch, rng, cudnn_attn, length, PREFIX_HIT_QUERY, args.reps)
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
        for num_seqs in args.decode_batch:
            result["decode"][f"{length}x{num_seqs}"] = _bench_decode(
                cp, bf16, torch, rng, cudnn_attn, length, num_seqs, args)
            cp.get_default_memory_pool().free_all_blocks()
            torch.cuda.empty_cache()
        print(json.dumps({k: v for k, v in result.items() if k != "cudnn"}), file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--decode-batch", default="1,32,128")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--graph-calls", type=int, default=20)
    parser.add_argument("--name", default="", help="the result file's name (default: dated)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.decode_batch = [int(x) for x in args.decode_batch.split(",")]
    import cupy as cp

    report = {"benchmark": "attention", "shape": {"num_q_heads": NUM_Q_HEADS,
                                                  "num_kv_heads": NUM_KV_HEADS,
                                                  "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE},
              "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
              "node": platform.node(),
              "date": now_iso(utc=True),
              "command": command("python -m benchmarks.attention", argv),
              **bench(args)}
    print(json.dumps(report, indent=2))
    path = write_result(args.out, f"{args.name or f'attention-{today()}'}.json", report)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
