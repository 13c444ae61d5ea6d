"""Launcher for ``embedding`` (embedding.cu); reference: ``kernels.reference.embedding``."""

from __future__ import annotations

import numpy as np

from kernels.cuda_module import BF16, INT32, check, contiguous, kernel


def embedding(token_ids, table):
    """Rows of bf16 ``table[V, H]`` for int32 ``token_ids[T]`` -> ``[T, H]``."""
    import cupy as cp

    token_ids = contiguous(token_ids)
    check(token_ids, "token_ids", INT32, 1)
    check(table, "table", BF16, 2)
    num_tokens, hidden = token_ids.shape[0], table.shape[1]
    out = cp.empty((num_tokens, hidden), dtype=BF16)
    if num_tokens:
        kernel("embedding", "embedding")((num_tokens,), (128,),
                                         (token_ids, table, out, np.int32(hidden),
                                          np.int64(table.shape[0])))
    return out
