"""Which store shard a vLLM worker's KV is: its pipeline stage and tensor-parallel rank.

A block's bytes are split over the workers that hold parts of it: each pipeline stage holds its
own layers, each tensor-parallel rank its own KV heads. Each part is kept under its own
``shard_namespace`` of the block's chain (same hashes and idents), and a hit needs every part
(the scheduler side looks up every shard). MLA's latent cache is the same on every
tensor-parallel rank (it is not split by heads): those ranks share one shard, each saving the
same bytes (the daemon keeps one copy) and loading from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVShard:
    """This worker's shard (``shard`` of ``num_shards``) and whether it speaks for all of them
    in reports (the KV events: every shard saves the same blocks)."""

    shard: int
    num_shards: int
    reports: bool


def kv_shard(tp_rank: int, tp_size: int, pp_rank: int, pp_size: int,
             replicated_over_tp: bool) -> KVShard:
    """The shard of the worker at (``pp_rank``, ``tp_rank``); stage-major, so stage 0's
    shards come first."""
    if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size):
        raise ValueError(f"rank tp {tp_rank}/{tp_size}, pp {pp_rank}/{pp_size}: out of range")
    per_stage = 1 if replicated_over_tp else tp_size
    shard = pp_rank * per_stage + (0 if replicated_over_tp else tp_rank)
    return KVShard(shard, pp_size * per_stage, reports=tp_rank == 0 and pp_rank == 0)


def num_kv_shards(tp_size: int, pp_size: int, replicated_over_tp: bool) -> int:
    """How many shards each block has (what the scheduler side looks up)."""
    return kv_shard(0, tp_size, 0, pp_size, replicated_over_tp).num_shards
