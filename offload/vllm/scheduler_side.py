"""The scheduler half of the connector: ask the store, plan loads, plan write-through saves.

``match`` asks the daemon (a lookup without a lease, through ``StoreClient``: bounded by
``lookup_timeout_s``, and given up at once while the client finds the daemon hung) how many of a
request's blocks past vLLM's own prefix hit the store holds; the worker takes the lease when it
loads (a lease belongs to the connection that took it). ``after_alloc`` turns a hit into a load of
the blocks vLLM reserved; ``plan_step`` adds the full blocks each scheduled request completes this
step as saves; the worker sends them without waiting, so a request with saves planned keeps its
blocks after it finished (``finished`` says so, and the worker reports it in
``finished_sending`` once its saves ended), and a preempted one has them flushed before the
next forward (``StepPlan.flush``). Loads in flight are budgeted (``max_load_blocks``, the
worker's staging room). Each request's load moves ``IDLE -> HIT -> LOADING -> IDLE``
(``tracked_request.py`` holds the states and their table).
Under tensor parallelism each rank keeps its shard of a block under its own namespace
(``shard_namespace``); this side asks about every shard at once (one deadline) and reports the
shortest hit, so every shard is touched (kept from eviction alike) and, in a cluster, fetched
from peers. A rank that still misses its shard at load time reports those blocks failed, and
vLLM recomputes them for every rank. vLLM's ``kv_role`` picks the directions: a
``kv_producer`` (the prefill instances of a disaggregated deployment) only saves, a
``kv_consumer`` (the decode instances) only loads, ``kv_both`` does both.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore import StoreState
from kvstore.keys import servable_blocks, shard_namespace
from offload.external.block_keys import KeyMaker, RequestKeys
from offload.external.plan import BlockTransfer, StepPlan
from offload.store_client import StoreClient
from offload.transfer import Transfer
from offload.vllm.block_events import BlockEvents, BlockInfo
from offload.vllm.tracked_request import LoadState, TrackedRequest

# A lookup is waited for in slices this long, so a daemon found hung ends the wait early.
_WAIT_SLICE_S = 0.05


@dataclass(frozen=True)
class ScheduledRequest:
    """A request in this step's schedule, as plain values."""

    request_id: str
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int
    new_block_ids: list[int] | None  # blocks added this step (None: none)
    replaces_blocks: bool = False  # resumed after preemption: the list is the whole table


class SchedulerSide:
    """Owns the scheduler's requests, its lookups and the load budget."""

    def __init__(self, keys: KeyMaker, client: StoreClient, max_load_blocks: int,
                 lookup_timeout_s: float, num_shards: int = 1, loads: bool = True,
                 saves: bool = True) -> None:
        """``client``: a store client without a layout (this side only looks up); ``num_shards``:
        the engine's tensor-parallel ranks, each storing its own shard of every block;
        ``loads``/``saves``: whether this instance takes hits / stores what it computes."""
        if max_load_blocks <= 0:
            raise ValueError("max_load_blocks must be positive")
        if num_shards < 1:
            raise ValueError(f"num_shards must be at least 1, got {num_shards}")
        if not (loads or saves):
            raise ValueError("a connector that neither loads nor saves has nothing to do")
        self.num_shards = num_shards
        self.loads, self.saves = loads, saves
        self.keys = keys
        self.client = client
        self.block_size = keys.block_size
        self.max_load_blocks = max_load_blocks
        self.lookup_timeout_s = lookup_timeout_s
        self.counters: Counter[str] = Counter()
        self._requests: dict[str, TrackedRequest] = {}
        self._loads_to_send: list[BlockTransfer] = []
        self._load_blocks_in_flight = 0
        # Requests with saves planned: the worker holds their blocks until the saves ended.
        self._saving: set[str] = set()
        self.events = BlockEvents(self.block_size)  # vLLM's KV events of the stored blocks

    # -------------------------------------------------------------------------------- lookups

    def match(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
              cache_salt: str | None, lora_id: str | None,
              block_hashes: Sequence[bytes] | None = None, lora_name: str | None = None) -> int:
        """Tokens past ``num_computed_tokens`` (block aligned) the store can load; 0 on a miss,
        a store that is down or slow, no load budget left, or an instance that does not load
        (a ``kv_producer``: it never asks). ``block_hashes`` (vLLM's, its live list) and
        ``lora_name`` only name the blocks in the KV events."""
        bs = self.block_size
        tracked = self._requests.get(request_id)
        if tracked is None:
            tracked = self._requests[request_id] = TrackedRequest(
                token_ids, cache_salt, lora_id, block_hashes=block_hashes, lora_name=lora_name)
        if tracked.state is LoadState.HIT:
            tracked.to(LoadState.IDLE)  # asked again: the hit is decided afresh
        tracked.hit_tiers = []
        if not self.loads:
            return 0  # a producer: its prompts are computed here and saved
        first = num_computed_tokens // bs
        last = servable_blocks(len(token_ids), bs)  # vLLM computes the last token itself
        room = min(self.max_load_blocks, self.max_load_blocks - self._load_blocks_in_flight)
        if first >= last:
            return 0
        if room <= 0:
            self.counters["lookups_skipped_budget"] += 1
            return 0
        keys = self.keys.keys(token_ids, cache_salt, lora_id, num_blocks=last)
        hashes, idents = keys.hashes[first:last], keys.idents[first:last]
        # No tier holds the first block (the daemon's key filter lacks it, whatever the shard):
        # a miss, without the round trip vLLM's scheduler would wait for.
        key_filter = self.client.key_filter
        if key_filter is not None and not key_filter.may_contain(hashes[0]):
            self.counters["lookups_skipped_absent"] += 1
            return 0
        self.counters["lookups"] += 1
        lookups = [self.client.lookup(shard_namespace(keys.namespace, shard, self.num_shards),
                                     hashes, idents, lease_ttl_s=0)
                   for shard in range(self.num_shards)]
        if not self._wait(lookups) or any(lookup.result is None for lookup in lookups):
            self.counters["lookup_failures"] += 1
            return 0
        reply = lookups[0].result
        self.events.looked_up(hashes, int(reply.num_hit), list(reply.tiers),
                              lambda i: self._block_info(tracked, keys, first + i))
        num_hit = min(room, *(int(lookup.result.num_hit) for lookup in lookups))
        if num_hit <= 0:
            self.counters["lookup_misses"] += 1
            return 0
        self.counters["lookup_hits"] += 1
        tracked.to(LoadState.HIT)
        tracked.first_block, tracked.num_hit_blocks = first, num_hit
        tracked.hit_tiers = list(reply.tiers[:num_hit])
        return num_hit * bs

    def _wait(self, lookups: list[Transfer]) -> bool:
        """Wait for the replies (the request waits in the scheduler meanwhile) at most
        ``lookup_timeout_s`` together, and not at all once the client finds the daemon hung, as
        kvengine's restores do; an unanswered lookup is a miss (it holds no lease)."""
        deadline = time.monotonic() + self.lookup_timeout_s
        for lookup in lookups:
            while not lookup.wait(min(_WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline or self.client.live_state is StoreState.HUNG:
                    self.counters["lookups_unanswered"] += 1
                    return False
        return True

    def hit_tiers(self, request_id: str) -> list[str]:
        """The tier of each block of the request's last hit (``dram``, ``ssd``, ``remote``...);
        kept after ``after_alloc``, which vLLM calls before it asks for the tiers."""
        tracked = self._requests.get(request_id)
        return list(tracked.hit_tiers) if tracked is not None else []

    # ---------------------------------------------------------------------------- allocation

    def after_alloc(self, request_id: str, block_ids: list[int],
                    num_external_tokens: int) -> None:
        """vLLM reserved ``block_ids`` (the request's whole table); a hit becomes a load."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            return
        tracked.block_ids = list(block_ids)
        if num_external_tokens <= 0 or tracked.state is not LoadState.HIT:
            return
        first = tracked.first_block
        num_blocks = min(tracked.num_hit_blocks, num_external_tokens // self.block_size)
        ids = tracked.block_ids[first:first + num_blocks]
        if len(ids) < num_blocks:
            raise ValueError(f"request {request_id}: {len(ids)} blocks reserved for a load of "
                             f"{num_blocks}")
        keys = self._keys(tracked, first + num_blocks)
        self._loads_to_send.append(BlockTransfer(
            request_id, ids, keys.namespace, keys.hashes[first:first + num_blocks],
            keys.idents[first:first + num_blocks]))
        tracked.to(LoadState.LOADING)
        tracked.load_ids, tracked.load_ok_blocks = ids, num_blocks
        self._load_blocks_in_flight += num_blocks
        tracked.num_stored_blocks = first + num_blocks  # already in the store: never saved back
        self.counters["loads_planned"] += 1
        self.counters["blocks_load_planned"] += num_blocks

    # -------------------------------------------------------------------------------- steps

    def plan_step(self, scheduled: list[ScheduledRequest],
                  preempted: Sequence[str] | set[str] = ()) -> StepPlan:
        """This step's loads (planned since the last step), saves (full blocks completed;
        none for an instance that does not save, a ``kv_consumer``) and flushes (requests
        ``preempted`` since the last step whose saves may still read their freed blocks)."""
        plan = StepPlan(loads=self._loads_to_send,
                        flush=sorted(rid for rid in preempted if rid in self._saving))
        self._loads_to_send = []
        bs = self.block_size
        for s in scheduled:
            tracked = self._requests.get(s.request_id)
            if tracked is None:
                continue
            if s.replaces_blocks:
                tracked.block_ids = list(s.new_block_ids or [])
            elif s.new_block_ids:
                tracked.block_ids.extend(s.new_block_ids)
            if tracked.num_stored_blocks == 0 and tracked.state is not LoadState.LOADING:
                # vLLM's own prefix hit was computed (and saved) before: start past it.
                tracked.num_stored_blocks = s.num_computed_tokens // bs
            if not self.saves:
                continue  # a consumer: what it computes stays its own
            computed = min(s.num_computed_tokens + s.num_scheduled_tokens,
                           len(tracked.token_ids))
            full = min(computed // bs, len(tracked.block_ids))
            start = tracked.num_stored_blocks
            if full <= start:
                continue
            keys = self._keys(tracked, full)
            save = BlockTransfer(s.request_id, tracked.block_ids[start:full], keys.namespace,
                                 keys.hashes[start:full], keys.idents[start:full])
            plan.saves.append(save)  # the worker cuts it to its mover's request size
            self.events.planned(s.request_id, save.hashes,
                                [self._block_info(tracked, keys, b) for b in range(start, full)])
            self._saving.add(s.request_id)
            tracked.num_stored_blocks = full
            self.counters["blocks_save_planned"] += full - start
        return plan

    def loads_finished(self, request_ids: set[str] | list[str]) -> None:
        """The worker reported these loads done (loaded or failed): their budget is free."""
        for rid in request_ids:
            tracked = self._requests.get(rid)
            if tracked is not None and tracked.state is LoadState.LOADING:
                self._load_blocks_in_flight -= tracked.num_loading_blocks
                tracked.load_ids = []
                tracked.to(LoadState.IDLE)

    def loads_failed(self, block_ids: set[int]) -> None:
        """Blocks the workers could not load: vLLM recomputes them, so they are saved again.
        Under tensor parallelism the ranks may report in different steps: every report
        counts until the load is finished, and the earliest failed block wins."""
        if not block_ids:
            return
        for tracked in self._requests.values():
            if tracked.state is not LoadState.LOADING:
                continue
            for i, block_id in enumerate(tracked.load_ids[:tracked.load_ok_blocks]):
                if block_id in block_ids:
                    tracked.num_stored_blocks = min(tracked.num_stored_blocks,
                                                    tracked.first_block + i)
                    self.counters["blocks_load_failed"] += tracked.load_ok_blocks - i
                    tracked.load_ok_blocks = i
                    break

    def finished(self, request_id: str) -> bool:
        """The request is done; a load still in flight keeps its budget until it reports.
        True if saves were planned for it: vLLM keeps its blocks until the worker reports it
        in ``finished_sending`` (the worker follows the same plans, so it reports exactly
        these)."""
        tracked = self._requests.pop(request_id, None)
        if tracked is not None:
            self._load_blocks_in_flight -= tracked.num_loading_blocks
        if request_id in self._saving:
            self._saving.discard(request_id)
            self.counters["requests_held_for_saves"] += 1
            return True
        return False

    def saved(self, store_hashes: Sequence[bytes]) -> None:
        """A worker reports that the daemon holds these blocks (its saves' outcomes)."""
        self.events.saved(store_hashes)

    def saves_ended(self, request_ids: Sequence[str] | set[str]) -> None:
        """The workers reported these requests' saves ended (``finished_sending``)."""
        for rid in request_ids:
            self.events.request_ended(rid)

    def reset(self) -> None:
        """vLLM's cache reset: blocks stored so far are never found again (new keys), and the
        events remove every block announced."""
        self.keys.reset()
        self.events.clear()
        for tracked in self._requests.values():
            if tracked.state is LoadState.HIT:
                tracked.to(LoadState.IDLE)
            tracked.hit_tiers = []
        self.counters["resets"] += 1

    @property
    def num_tracked(self) -> int:
        return len(self._requests)

    def _block_info(self, tracked: TrackedRequest, keys: RequestKeys, index: int) -> BlockInfo:
        """Block ``index`` of a request as the KV events name it: vLLM's hash where vLLM has
        one, else the store's (``keys`` covers the block)."""
        names = tracked.block_hashes
        if names is None or len(names) <= index:
            names = keys.hashes
        bs = self.block_size
        return BlockInfo(bytes(names[index]), bytes(names[index - 1]) if index else None,
                         tuple(tracked.token_ids[index * bs:(index + 1) * bs]),
                         tracked.lora_name)

    def _keys(self, tracked: TrackedRequest, num_blocks: int) -> RequestKeys:
        return self.keys.keys(tracked.token_ids, tracked.cache_salt, tracked.lora_id,
                              num_blocks=num_blocks)
