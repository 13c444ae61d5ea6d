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
from typing import Any

from offload.vllm.model_identity import spec_kind


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


@dataclass(frozen=True)
class ParallelLayout:
    """How vLLM splits one instance over workers: tensor-parallel size, pipeline stages, and
    whether the KV is the same on every tensor-parallel rank (MLA's latent cache)."""

    tp_size: int
    pp_size: int
    replicated_over_tp: bool

    @classmethod
    def from_vllm(cls, parallel_config: Any, kv_cache_config: Any) -> ParallelLayout:
        """From vLLM's configs; ValueError for context parallelism (a context-parallel rank
        holds other tokens of the same block: keys per rank would mix them, and no run has
        checked what such a worker's KV tensors hold)."""
        unsupported = {name: getattr(parallel_config, name, 1) for name in (
            "prefill_context_parallel_size", "decode_context_parallel_size")}
        unsupported = {name: size for name, size in unsupported.items() if size != 1}
        if unsupported:
            raise ValueError(f"KVStoreConnector supports tensor, pipeline and data "
                             f"parallelism, not context parallelism ({unsupported})")
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        return cls(int(parallel_config.tensor_parallel_size),
                   int(getattr(parallel_config, "pipeline_parallel_size", 1)),
                   spec_kind(spec) == "mla")

    @property
    def num_shards(self) -> int:
        return num_kv_shards(self.tp_size, self.pp_size, self.replicated_over_tp)

    def worker_ranks(self) -> tuple[int, int]:
        """This worker's (tensor-parallel rank, pipeline stage), asked of vLLM's process
        groups; (0, 0) without either."""
        if self.tp_size == 1 and self.pp_size == 1:
            return 0, 0
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp, pp = get_tp_group(), get_pp_group()
        if tp.world_size != self.tp_size or pp.world_size != self.pp_size:
            raise ValueError(f"parallel world sizes tp {tp.world_size}, pp {pp.world_size} "
                             f"differ from the config's {self.tp_size}, {self.pp_size}")
        return int(tp.rank_in_group), int(pp.rank_in_group)

    def shard(self, tp_rank: int, pp_rank: int) -> KVShard:
        """The shard of the worker at these ranks."""
        return kv_shard(tp_rank, self.tp_size, pp_rank, self.pp_size, self.replicated_over_tp)
