"""How many KV blocks the arena gets and how long a sequence may be: plain arithmetic."""

from __future__ import annotations

import math

from engine.config import EngineConfig


def max_len_limit(config: EngineConfig, max_position_embeddings: int) -> int:
    """The model length before the KV arena caps it; an explicit value past the model's is an
    error."""
    if config.max_model_len is None:
        return max_position_embeddings
    if config.max_model_len > max_position_embeddings:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                         f"max_position_embeddings {max_position_embeddings}")
    return config.max_model_len


def gpu_kv_budget_bytes(free_bytes: int, total_bytes: int, utilization: float) -> int:
    """KV bytes that keep the process within ``utilization`` of the device, given what is in use
    now (weights loaded). Activation peaks are not included: the CUDA backend should measure one
    full-size step first and subtract it."""
    return int(total_bytes * utilization) - (total_bytes - free_bytes)


def plan_capacity(
    config: EngineConfig, limit: int, block_bytes: int, budget_bytes: int
) -> tuple[int, int]:
    """(num_kv_blocks, max_model_len). ``num_kv_blocks`` is the configured one, else what
    ``budget_bytes`` holds, no more than ``max_num_seqs`` sequences of ``limit`` tokens need;
    ``max_model_len`` is ``limit`` capped to the arena."""
    bs = config.block_size
    num_blocks = config.num_kv_blocks
    if num_blocks is None:
        useful = config.max_num_seqs * math.ceil(limit / bs)
        num_blocks = min(max(budget_bytes, 0) // block_bytes, useful)
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes cannot hold one KV block of "
                             f"{block_bytes} bytes")
    capacity = num_blocks * bs
    if config.max_model_len is not None and config.max_model_len > capacity:
        raise ValueError(f"max_model_len {config.max_model_len} needs more than the "
                         f"{num_blocks} KV blocks ({capacity} tokens)")
    return num_blocks, min(limit, capacity)


def kv_budget_bytes(config: EngineConfig, device: str) -> int:
    """The budget for an automatically sized arena on ``device`` (read now, after weights)."""
    if device == "cpu":
        return config.cpu_kv_cache_bytes
    import cupy

    free_bytes, total_bytes = cupy.cuda.runtime.memGetInfo()
    return gpu_kv_budget_bytes(free_bytes, total_bytes, config.gpu_memory_utilization)
