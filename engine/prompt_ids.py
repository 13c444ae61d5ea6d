"""A prompt's token ids checked once on the way in: a fresh list of ints and the int32-LE bytes
the block hashes are made of, or one clear ValueError (not integers, empty, longer than the
engine's context, outside the vocabulary)."""

from __future__ import annotations

import operator
import struct

import numpy as np


def checked_prompt(prompt_token_ids: list[int], vocab_size: int,
                   max_model_len: int) -> tuple[list[int], bytes]:
    """The prompt as a fresh list of ints plus its int32-LE bytes; ValueError unless it is
    1..max_model_len integers in [0, vocab_size)."""
    if not isinstance(prompt_token_ids, (list, tuple)):
        try:
            prompt_token_ids = list(prompt_token_ids)
        except TypeError:
            raise ValueError("prompt_token_ids must be a list of integers") from None
    # One C-level pass converts and checks every id (an integer that fits int32).
    try:
        token_bytes: bytes | None = struct.pack(f"<{len(prompt_token_ids)}i",
                                                *prompt_token_ids)
    except (struct.error, TypeError, ValueError, OverflowError):
        try:  # which error to report: not integers, or out of range (vocab ids fit int32)
            for t in prompt_token_ids:
                operator.index(t)
        except TypeError:
            raise ValueError("prompt_token_ids must be a list of integers") from None
        token_bytes = None
    num_tokens = len(prompt_token_ids)
    if not num_tokens:
        raise ValueError("the prompt is empty")
    if num_tokens > max_model_len:
        raise ValueError(f"the prompt has {num_tokens} tokens, more than max_model_len "
                         f"{max_model_len}")
    tokens = np.frombuffer(token_bytes or b"", dtype="<i4")
    if token_bytes is None or int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    return tokens.tolist(), token_bytes
