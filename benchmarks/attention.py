"""Our paged attention kernels against torch SDPA on the same shapes (one layer, Qwen3-4B heads).

Prefill: one sequence of L tokens, causal, K/V read from the paged arena (block_size 16, shuffled
blocks), in every (warps, rows per warp) variant of the kernel, against
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` on contiguous bf16 tensors
(flash backend). Decode: one query per sequence over a context of L, at batch 1 and 32, against
SDPA with one query. GPU times by CUDA events, median of --reps. Writes JSON to
benchmarks/results/.

    python -m benchmarks.attention [--lengths 1024,4096,16384] [--reps 20]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import numpy as np

from benchmarks.common import command, cuda_median_ms, now_iso, today, write_result

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
# (warps per CTA, query rows per warp, keys per tile)
PREFILL_VARIANTS = [(4, 32, 64), (8, 32, 64), (4, 32, 32), (8, 32, 32), (8, 16, 64)]


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


def bench(args: argparse.Namespace) -> dict:
    import cupy as cp
    import ml_dtypes
    import torch
    import torch.nn.functional as F

    from kernels.attention import paged_attention_decode, paged_attention_prefill

    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    scale = HEAD_DIM**-0.5
    result: dict = {"prefill": {}, "decode": {}}
    for length in args.lengths:
        kv, tables = _arena(cp, bf16, rng, 1, length)
        q = _random_bf16(cp, bf16, (length, NUM_Q_HEADS, HEAD_DIM))
        cu = cp.asarray(np.array([0, length], dtype=np.int32))
        ctx = cp.asarray(np.array([length], dtype=np.int32))
        variants = {f"{w}x{r}x{n}": cuda_median_ms(
            cp, lambda q=q, kv=kv, t=tables, cu=cu, c=ctx, w=w, r=r, n=n: paged_attention_prefill(
                q, kv, 0, t, cu, c, scale, num_warps=w, rows_per_warp=r, keys_per_tile=n),
            args.reps) for w, r, n in PREFILL_VARIANTS}
        ours = cuda_median_ms(  # the engine's default variant
            cp, lambda q=q, kv=kv, t=tables, cu=cu, c=ctx: paged_attention_prefill(
                q, kv, 0, t, cu, c, scale), args.reps)
        tq = torch.randn(1, NUM_Q_HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        tk = torch.randn(1, NUM_KV_HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        tv = torch.randn_like(tk)
        sdpa = cuda_median_ms(cp, lambda tq=tq, tk=tk, tv=tv: F.scaled_dot_product_attention(
            tq, tk, tv, is_causal=True, enable_gqa=True), args.reps)
        flops = 4 * length * length * NUM_Q_HEADS * HEAD_DIM / 2  # causal: half the square
        result["prefill"][str(length)] = {
            "ours_ms": ours, "sdpa_ms": sdpa,
            "variants_ms (warps x rows per warp x keys per tile)": variants,
            "ours_tflops": flops / ours / 1e9, "sdpa_tflops": flops / sdpa / 1e9}
        del kv, tables, q, tq, tk, tv
        for num_seqs in args.decode_batch:
            kv, tables = _arena(cp, bf16, rng, num_seqs, length)
            q = _random_bf16(cp, bf16, (num_seqs, NUM_Q_HEADS, HEAD_DIM))
            ctx = cp.asarray(np.full(num_seqs, length, dtype=np.int32))
            ours = cuda_median_ms(cp, lambda q=q, kv=kv, t=tables, c=ctx: paged_attention_decode(
                q, kv, 0, t, c, scale), args.reps)
            tq = torch.randn(num_seqs, NUM_Q_HEADS, 1, HEAD_DIM, device="cuda",
                             dtype=torch.bfloat16)
            tk = torch.randn(num_seqs, NUM_KV_HEADS, length, HEAD_DIM, device="cuda",
                             dtype=torch.bfloat16)
            tv = torch.randn_like(tk)
            sdpa = cuda_median_ms(cp, lambda tq=tq, tk=tk, tv=tv: F.scaled_dot_product_attention(
                tq, tk, tv, enable_gqa=True), args.reps)
            kv_bytes = 2 * num_seqs * length * NUM_KV_HEADS * HEAD_DIM * 2
            result["decode"][f"{length}x{num_seqs}"] = {
                "ours_ms": ours, "sdpa_ms": sdpa, "ours_kv_gbps": kv_bytes / ours / 1e6,
                "sdpa_kv_gbps": kv_bytes / sdpa / 1e6}
            del kv, tables, q, tq, tk, tv
        cp.get_default_memory_pool().free_all_blocks()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--decode-batch", default="1,32")
    parser.add_argument("--reps", type=int, default=20)
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
    path = write_result(args.out, f"attention-{today()}.json", report)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
