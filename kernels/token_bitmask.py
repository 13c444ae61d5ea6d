"""Launcher for ``apply_token_bitmask`` (token_bitmask.cu); reference:
``kernels.reference.apply_token_bitmask``."""

from __future__ import annotations

import numpy as np

from kernels.cuda_module import FLOAT32, INT32, check, kernel

_THREADS = 256  # token_bitmask.cu's THREADS


def apply_token_bitmask(logits, bitmask, rows) -> None:
    """In place: ``logits[rows[r], v] = -inf`` where bit ``v`` of ``bitmask[r]`` is 0.
    ``logits[B, V]`` float32, ``bitmask[R, W]`` int32 with ``32 W >= V``, ``rows[R]`` int32
    distinct row indices below ``B`` (not checked on the device)."""
    check(logits, "logits", FLOAT32, 2)
    check(bitmask, "bitmask", INT32, 2)
    check(rows, "rows", INT32, 1)
    num_rows, num_words = bitmask.shape
    vocab = logits.shape[1]
    if rows.shape[0] != num_rows:
        raise ValueError(f"{num_rows} mask rows but {rows.shape[0]} row indices")
    if 32 * num_words < vocab:
        raise ValueError(f"a mask of {num_words} words covers {32 * num_words} tokens, the "
                         f"logits have {vocab}")
    if num_rows == 0 or vocab == 0:
        return
    grid = (-(-vocab // _THREADS), num_rows)
    kernel("token_bitmask", "apply_token_bitmask")(
        grid, (_THREADS,), (logits, bitmask, rows, np.int32(vocab), np.int32(num_words)))
