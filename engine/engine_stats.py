"""EngineCounters: what the step loop counts, and ``LLMEngine.stats()`` made from the parts.

The keys are a contract (the server types them as ``EngineStats`` and exports them as metrics):
requests by state, the block manager's blocks, prefix-cache queries and hits by tier, tokens,
preemptions, steps, and the store bridge's own stats under ``kv_offload``.
"""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.outputs import empty_tier_counts
from engine.scheduler import Scheduler
from offload.bridge import StoreBridge


class EngineCounters:
    """The step loop's counters and the stats as of the last step. ``count_token`` and
    ``end_step`` run on the step thread, ``latest`` on any; the engine holds its lock around
    ``end_step`` and ``latest``, so a reader sees one step's stats whole."""

    def __init__(self, block_manager: BlockManager, scheduler: Scheduler,
                 offload: StoreBridge) -> None:
        self._block_manager = block_manager
        self._scheduler = scheduler
        self._offload = offload
        self._num_generation_tokens = 0
        self._num_finished = 0
        self._num_steps = 0
        self._last = self._collect()

    def count_token(self) -> None:
        """A request got a token."""
        self._num_generation_tokens += 1

    def end_step(self, num_finished: int) -> None:
        """A step ended, ``num_finished`` requests with it: its stats become the latest."""
        self._num_finished += num_finished
        self._num_steps += 1
        self._last = self._collect()

    def latest(self, num_queued: int) -> dict:
        """The stats as of the last step, the ``num_queued`` requests no step took yet counted
        as waiting, the store's health as of now."""
        stats = dict(self._last)
        stats["num_waiting"] += num_queued
        if stats["kv_offload"] is not None:
            stats["kv_offload"] = {**stats["kv_offload"], "store_state": self._offload.store_state}
        return stats

    def _collect(self) -> dict:
        bm, sched = self._block_manager, self._scheduler
        hit_tokens = empty_tier_counts()
        hit_tokens.update(self._offload.restores.hit_tokens_by_tier)
        hit_tokens["hbm"] += sched.num_prefix_hit_tokens  # own prefix cache (peers': hbm_peer)
        return {
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting) - sched.num_loading,
            "num_loading": sched.num_loading,
            "num_kv_blocks": bm.num_blocks,
            "num_blocks_in_use": bm.num_used_blocks,
            "num_blocks_cached": bm.num_cached_blocks,
            "block_size": bm.block_size,
            "prefix_cache_queries": sched.num_prefix_query_tokens,
            "prefix_cache_hit_tokens": hit_tokens,
            "prefix_cache_evictions": bm.num_evictions,
            "prefix_cache_collisions": bm.num_collisions,
            "prompt_tokens_total": sched.num_prompt_tokens,
            "generation_tokens_total": self._num_generation_tokens,
            "num_preemptions": sched.num_preemptions,
            "prefix_cache_hits": sched.num_prefix_hit_tokens,  # this engine's own cache only
            "num_requests_finished": self._num_finished,
            "num_steps": self._num_steps,
            "kv_offload": self._offload.stats(),
        }
