"""What the vLLM connector reports to vLLM: its counters (``KVConnectorStats``, summed over the
workers), their Prometheus series on vLLM's ``/metrics``, and the KV events (the workers' report
of stored blocks through vLLM's KV-event channel, and the scheduler side's events as vLLM's
``BlockStored`` / ``BlockRemoved``). With ``connector.py``, the only modules that import vLLM
at their top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from offload.vllm.block_events import BlockEvent, BlocksStored

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """Counters for one interval: the workers' (blocks loaded, saved, failed..., summed over
    workers) and the scheduler's (``scheduler_*``), each with its store client's."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVStoreStoredBlocks(KVConnectorKVEvents):
    """What a worker tells the scheduler side through vLLM's KV-event channel: the store hashes
    of blocks the daemon holds after its saves (rank 0's: every rank follows the same plans);
    the scheduler side turns them into vLLM's events (``take_events``)."""

    def __init__(self, store_hashes: list[bytes] | None = None) -> None:
        self._hashes = list(store_hashes or [])
        self._num_workers = 1

    def add_events(self, events: list[Any]) -> None:
        self._hashes.extend(events)

    def aggregate(self) -> KVStoreStoredBlocks:
        self._hashes = list(dict.fromkeys(self._hashes))
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._num_workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._hashes)

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def clear_events(self) -> None:
        self._hashes = []


def vllm_event(event: BlockEvent) -> KVCacheEvent:
    """One of the connector's events as vLLM publishes it."""
    if isinstance(event, BlocksStored):
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in event.block_hashes],
            parent_block_hash=(maybe_convert_block_hash(event.parent_block_hash)
                               if event.parent_block_hash is not None else None),
            token_ids=event.token_ids, block_size=event.block_size, lora_id=None,
            medium=event.medium, lora_name=event.lora_name, group_idx=0,
            locality=event.locality)
    return BlockRemoved(block_hashes=[maybe_convert_block_hash(h) for h in event.block_hashes],
                        medium=event.medium, group_idx=0, locality=event.locality)


class KVStorePromMetrics(KVConnectorPromMetrics):
    """The connector's counters on vLLM's ``/metrics``: ``vllm:kvstore_events_total`` with an
    ``event`` label per counter (the workers' ``blocks_loaded``, ``blocks_saved``,
    ``load_errors``...; the scheduler's ``scheduler_lookup_hits``...; their links' ``link_*`` and
    ``scheduler_link_*``), per engine."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._events = self._counter_cls(
            name="vllm:kvstore_events",
            documentation="kvstore connector events: blocks loaded, saved, failed; lookups "
                          "and their outcomes; connections to the store (label: event).",
            labelnames=[*labelnames, "event"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for event, value in transfer_stats_data.items():
            if value > 0:  # the stats are increments since the last report
                self._events.labels(*labels, event).inc(value)
