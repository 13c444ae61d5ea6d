"""Compile, before ready, every kernel a request's path can reach on the CUDA backend.

NVRTC compiles one of our ``.cu`` families per set of defines on first use (``cuda_module``), about
2.5 s each on a machine whose CuPy cache is cold, and CuPy compiles its own elementwise and
reduction kernels the same way, in less. The engine's warm-up captures graphs for the shapes it
knows, which compiles what those steps use, but not what only some requests meet later: our
attention kernels, which serve every shape cuDNN has no graph for yet (two variants and their
merge; an H200 stalled 5 s on them at the first uncovered multi-sequence prefill:
``benchmarks/kernel_first_use.py``), the sampling kernels of a
first request with a temperature, top-k or top-p, and the grammar mask of a first structured
output. Each runs here once on a few rows of zeros, the same launch a request makes; its results
are thrown away.
"""

from __future__ import annotations

from kernels import attention, gather_kv, sampling, token_bitmask
from kernels.cuda_module import BF16, kernel

_BLOCKS = 8  # the tiny arena's blocks: two 64-key tiles at block size 16, so a split merges


def warm_kernels(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 vocab_size: int) -> None:
    """Runs each launch once at the model's head shape and vocabulary on the current device."""
    import cupy as cp

    arena = cp.zeros((_BLOCKS, 1, 2, block_size, num_kv_heads, head_dim), dtype=BF16)
    table = cp.arange(_BLOCKS, dtype=cp.int32)[None, :]
    keys = cp.asarray([_BLOCKS * block_size], dtype=cp.int32)
    scale = head_dim ** -0.5
    for rows, rows_per_warp in ((1, 16), (64, 32)):  # the short-query and the long variant
        q = cp.zeros((rows, num_q_heads, head_dim), dtype=BF16)
        cu_seqlens = cp.asarray([0, rows], dtype=cp.int32)
        split = 64 if _BLOCKS * block_size > 64 else None  # two splits: their merge too
        attention.paged_attention_prefill(q, arena, 0, table, cu_seqlens, keys, scale,
                                          rows_per_warp=rows_per_warp, keys_per_split=split)
    attention.paged_attention_decode(cp.zeros((1, num_q_heads, head_dim), dtype=BF16), arena, 0,
                                     table, keys, scale)
    gather_kv.gather_kv(arena, 0, table)
    for function in ("split_meta", "replicate_q", "merge_partials"):  # cuDNN's split prefill
        kernel("split_prefill", function)  # compiled: its launches need a whole split step
    logits = cp.zeros((2, vocab_size), dtype=cp.float32)
    sampling.argmax(logits)
    probs = sampling.sampling_probs(logits, cp.asarray([0.7, 1.0], dtype=cp.float32),
                                    cp.asarray([5, 0], dtype=cp.int32),
                                    cp.asarray([1.0, 0.9], dtype=cp.float32))
    sampling.sample_from_probs(probs, cp.asarray([0.25, 0.75], dtype=cp.float32))
    words = -(-vocab_size // 32)
    token_bitmask.apply_token_bitmask(logits, cp.full((1, words), -1, dtype=cp.int32),
                                      cp.zeros(1, dtype=cp.int32))
    cp.cuda.get_current_stream().synchronize()
