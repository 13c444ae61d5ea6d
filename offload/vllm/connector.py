"""kvstore as a vLLM v1 KV connector: the thin class vLLM loads (with ``reports.py``, the only
modules importing vllm at their top).

Enable with::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kv_store_socket": "/path/kvstore.sock"}}'

vLLM knows the name through the ``vllm.general_plugins`` entry point (``kvstore_tiered_vllm``,
which also keeps a ``kvstore/`` or ``offload/`` folder in the working directory from replacing
the installed packages); ``"kv_connector_module_path": "offload.vllm_connector"`` works too
(that module hands on this class).

Everything with logic lives beside it in ``offload/vllm/`` and in ``offload/external/`` (tested
without vLLM); this class only turns vLLM's objects (requests, scheduler output, tensors) into
plain values and back.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import (
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from offload.external.block_keys import KeyMaker
from offload.external.block_mover import BlockMover
from offload.external.device_staging import packing_unavailable
from offload.external.kv_tensors import make_mover
from offload.external.plan import StepPlan
from offload.external.worker_side import WorkerSide
from offload.store_client import StoreClient
from offload.vllm.kv_shards import ParallelLayout
from offload.vllm.model_identity import identity_from_config, kv_format
from offload.vllm.reports import (
    KVStoreConnectorStats,
    KVStorePromMetrics,
    KVStoreStoredBlocks,
    vllm_event,
)
from offload.vllm.scheduler_side import ScheduledRequest, SchedulerSide
from offload.vllm.settings import ConnectorSettings, check_extra_config
from offload.vllm.staging_room import StagingRoom

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("offload.vllm")

_TIER_SOURCES = {"hbm": CacheHitSource.DEVICE, "dram": CacheHitSource.HOST,
                 "ssd": CacheHitSource.DISK, "remote": CacheHitSource.P2P}


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


class KVStoreConnector(KVConnectorBase_V1):
    """vLLM's handle on kvstore: scheduler side (lookups, plans) or worker side (copies)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # Tensor and pipeline parallelism: every worker stores its part of a block (its KV
        # heads, its stage's layers) under its own shard namespace (``kv_shards.py``); the
        # scheduler side looks up every shard.
        self._layout = ParallelLayout.from_vllm(vllm_config.parallel_config, kv_cache_config)
        self._num_shards = self._layout.num_shards
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.settings = ConnectorSettings.from_extra_config(extra)
        self.identity = identity_from_config(vllm_config, kv_cache_config)
        self.keys = KeyMaker(self.identity)
        self._layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._failed_block_ids: set[int] = set()
        self._reported: Counter[str] = Counter()
        if role == KVConnectorRole.SCHEDULER:
            self._recompute_failed_loads()
            # The scheduler side only looks up: a store client without a registration. The
            # worker's (with vLLM's KV memory) is made in register_kv_caches.
            client = StoreClient(self.settings.kv_store_socket, None,
                                 f"vllm-scheduler-{os.getpid()}",
                                 self.settings.load_timeout_s,
                                 self.settings.retry_interval_s)
            config = self._kv_transfer_config
            self._scheduler = SchedulerSide(self.keys, client, self.settings.load_blocks,
                                            self.settings.lookup_timeout_s, self._num_shards,
                                            loads=config.is_kv_consumer,
                                            saves=config.is_kv_producer)

    # ------------------------------------------------------------------------- scheduler side

    def _recompute_failed_loads(self) -> None:
        """vLLM 0.32 fails a request whose KV load failed unless ``kv_load_failure_policy`` is
        "recompute" (its default is "fail"). For a cache a block it cannot deliver (evicted
        since the lookup, damaged on SSD, a daemon gone) is a miss: the scheduler, which reads
        the policy right after building this connector, is switched to recompute."""
        config = self._kv_transfer_config
        if getattr(config, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kvstore connector: kv_load_failure_policy %r -> 'recompute' (a block "
                        "the store cannot deliver is recomputed, never a failed request)",
                        config.kv_load_failure_policy)
            config.kv_load_failure_policy = "recompute"

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if getattr(request, "mm_features", None):
            return 0, False  # placeholder token ids do not identify image inputs
        lora = request.lora_request
        n = self._scheduler.match(request.request_id, request.all_token_ids,
                                  num_computed_tokens, request.cache_salt,
                                  f"{lora.lora_name}:{lora.lora_int_id}" if lora else None,
                                  block_hashes=getattr(request, "block_hashes", None),
                                  lora_name=lora.lora_name if lora else None)
        return n, n > 0

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        if num_external_tokens <= 0:
            return {}
        tiers = self._scheduler.hit_tiers(request.request_id)
        bs = self.identity.block_size
        out: Counter = Counter()
        for tier in tiers[:num_external_tokens // bs]:
            out[_TIER_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)] += bs
        rest = num_external_tokens - sum(out.values())
        if rest > 0:  # tokens without a known tier: counted, never credited to a tier
            out[CacheHitSource.EXTERNAL_UNSPECIFIED] += rest
        return dict(out)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request.request_id, list(blocks.get_block_ids()[0]),
                                    num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduled = []
        num_tokens = scheduler_output.num_scheduled_tokens
        for r in scheduler_output.scheduled_new_reqs:
            scheduled.append(ScheduledRequest(r.req_id, r.num_computed_tokens,
                                              num_tokens.get(r.req_id, 0), list(r.block_ids[0]),
                                              replaces_blocks=True))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            scheduled.append(ScheduledRequest(
                rid, cached.num_computed_tokens[i], num_tokens.get(rid, 0),
                list(new_ids[0]) if new_ids is not None else None,
                replaces_blocks=rid in resumed))
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or set()
        return KVStoreConnectorMetadata(plan=self._scheduler.plan_step(scheduled, preempted))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # Failed blocks first: they belong to loads that are reported finished in the same pass.
        self._scheduler.loads_failed(set(getattr(connector_output, "invalid_block_ids", None)
                                         or ()))
        if connector_output.finished_recving:
            self._scheduler.loads_finished(connector_output.finished_recving)
        stored = getattr(connector_output, "kv_cache_events", None)
        if isinstance(stored, KVStoreStoredBlocks):  # before the saves that ended with them
            self._scheduler.saved(stored.aggregate().get_all_events())
        if connector_output.finished_sending:
            self._scheduler.saves_ended(connector_output.finished_sending)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """vLLM's KV events (published when ``--kv-events-config`` enables them) of the
        blocks this instance stored in, and saw move or leave, the store: BlockStored and
        BlockRemoved with medium CPU (the daemon's DRAM) or STORAGE (its SSD), locality
        REMOTE for a peer daemon's copy (``offload/vllm/block_events.py``)."""
        if self._scheduler is None:
            return ()
        return [vllm_event(event) for event in self._scheduler.events.take()]

    def reset_cache(self) -> bool | None:
        """vLLM's ``/reset_prefix_cache`` with the connector: blocks stored so far are never
        found again by this instance (its keys change) and their events remove them."""
        if self._scheduler is None:
            return None
        self._scheduler.reset()
        log.info("kvstore connector: cache reset (%d so far): earlier blocks are not used again",
                 self._scheduler.keys.num_resets)
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a save lost to a preemption is a later miss, so vLLM need
        not drop a preempted request's output (its default for producers)."""
        return False

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # True: saves were planned for it; its blocks stay vLLM's until the workers report it
        # in finished_sending (their saves ended: never a step's wait).
        return self._scheduler.finished(request.request_id), None

    # ---------------------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = [n for n in self._layer_names if n in kv_caches] or sorted(kv_caches)
        tensors = [kv_caches[n] for n in names]
        mover = self._make_mover(names, tensors)
        tp_rank, pp_rank = self._layout.worker_ranks()
        self._shard = self._layout.shard(tp_rank, pp_rank)
        log.info("kvstore connector: %d layers, block size %d, namespace layout %s, tensor "
                 "layout %s, tensor-parallel rank %d of %d, pipeline stage %d of %d, shard %d "
                 "of %d", len(names), self.identity.block_size, kv_format(self.identity),
                 mover.meta.get("tensor_layout"), tp_rank, self._layout.tp_size, pp_rank,
                 self._layout.pp_size, self._shard.shard, self._num_shards)
        # One per instance and worker.
        engine_id = f"vllm-{os.getpid()}-{id(self):x}-tp{tp_rank}-pp{pp_rank}"
        self._worker = WorkerSide(self.settings.kv_store_socket, mover, engine_id,
                                  self.settings.load_timeout_s, self.settings.save_timeout_s,
                                  self.settings.register_timeout_s,
                                  self.settings.retry_interval_s, self._shard.shard,
                                  self._num_shards)
        self._on_cuda = tensors[0].is_cuda
        if not self._worker.connect():
            log.warning("kvstore connector: no store at start; vLLM recomputes until it is up")

    def _make_mover(self, names: list[str], tensors: list[torch.Tensor]) -> BlockMover:
        # The identity and the shard count tell a router (``kvengine router`` in front of vLLM)
        # how this instance keys its blocks at the daemon (the daemon's ``engines`` verb).
        meta = {"engine": "vllm", "block_size": self.identity.block_size,
                "namespace_layout": kv_format(self.identity),
                "model_identity": asdict(self.identity),
                "num_shards": self._num_shards}
        # Staging room for the directions this instance's kv_role uses.
        config = self._kv_transfer_config
        block_bytes = sum(t.numel() * t.element_size() for t in tensors) // self._num_blocks
        room = StagingRoom.of(self.settings, bool(config.is_kv_consumer),
                              bool(config.is_kv_producer), bool(tensors[0].is_cuda),
                              block_bytes, packing_unavailable)
        if room.note is not None:
            log.info("%s", room.note)
        try:
            return room.mover(names, tensors, self._num_blocks, meta)
        except Exception as exc:  # the staging's memory or its kernel's build
            if not room.device_slots or self.settings.device_staging_blocks is not None:
                raise  # asked for by size: its failure is the answer
            log.warning("kvstore connector: device staging could not start (%s); the daemon "
                        "moves vLLM's pieces in place", exc)
            return make_mover(names, tensors, self._num_blocks, room.num_slots, meta)

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KVStoreConnectorMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is None:
            return
        self._worker.pump_saves()  # the last step's saves go out beside this forward
        plan = self._plan()
        if plan is not None and plan.loads:
            self._worker.start(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # loads are async: a request runs only after its load finished

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        pass  # whole blocks are saved after the forward (wait_for_save)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward: requests preempted since the last step lose their blocks to
        others in this step, so their saves still in flight end first (bounded)."""
        plan = getattr(kv_connector_metadata, "plan", None)
        if plan is not None and plan.flush and self._worker is not None:
            self._worker.flush(plan.flush)

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is None or not plan.saves or self._worker is None:
            return
        ready = None
        if self._on_cuda:
            # The daemon copies on its own stream: a save goes out once the step's compute
            # (queued before this event) has written its blocks. Nothing here waits.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
            ready = event.query
        self._worker.save(plan, ready)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        if self._worker is None:
            return None, None
        finished, failed = self._worker.poll()
        self._failed_block_ids |= failed
        sending = self._worker.finished_saving(finished_req_ids)
        return sending or None, finished or None

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        """The first worker's report of the blocks the daemon holds after its saves (every
        worker saves the same blocks, each its own shard)."""
        if self._worker is None or not self._shard.reports:
            return None
        stored = self._worker.take_stored()
        return KVStoreStoredBlocks(stored) if stored else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What this side counted since its last report (vLLM sums the workers' and adds the
        scheduler's)."""
        counters = self._counters()
        delta = {k: v - self._reported[k] for k, v in counters.items() if v != self._reported[k]}
        self._reported = Counter(counters)
        return KVStoreConnectorStats(data=delta) if delta else None

    def _counters(self) -> Counter[str]:
        """The worker's counters, or the scheduler's under ``scheduler_``; their store clients'
        (requests, connects, probes, store_hung...) under ``link_`` / ``scheduler_link_``."""
        out: Counter[str] = Counter()
        if self._worker is not None:
            out.update(self._worker.counters)
            out.update({f"link_{k}": v for k, v in self._worker.client.counters.items()})
        if self._scheduler is not None:
            out.update({f"scheduler_{k}": v for k, v in self._scheduler.counters.items()})
            out.update({f"scheduler_link_{k}": v
                        for k, v in self._scheduler.client.counters.items()})
        return out

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """vLLM asks this while it builds its config (with full CUDA graphs): the settings are
        checked here too, so a bad one fails before the model loads. Whole blocks are saved
        after the forward, so any CUDA graph mode works."""
        check_extra_config(extra_config)
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.drain(2.0)
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.client.close()
