"""Decides what runs each step: continuous batching, chunked prefill, preemption by recompute.

A step has a token budget (``max_num_batched_tokens``). Decoding sequences go first, one token
each, in admission order. The rest of the budget goes to prefill chunks in the order of
``engine/prefill_order.py``: by default the sequence with the least prompt left first (a turn
restored from the store, or an HBM hit, does not wait behind another user's long cold prompt),
and a sequence that has waited its bound of steps for a chunk before everyone else. The waiting
queue is admitted in arrival order: its head competes for the budget with the running prefills.
When a sequence needs a block and none is free, the most recently admitted running sequence not
yet in the batch is preempted (itself if none is left): its blocks are freed (full ones stay in
the prefix cache) and it goes back to the head of the waiting queue to be recomputed; nobody is
admitted in a step that preempted. With ``--kv-offload``, waiting sequences near the head are
handed to the store bridge in every step whatever the budget (a load costs no step tokens), and
again while the device runs the step, once their lookups are answered: a restore of a request that
arrived during a step starts its load during that step, not after the next schedule.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.outputs import FinishReason
from engine.prefill_order import PrefillOrder
from engine.sequence import Sequence, SequenceStatus
from offload.bridge import RestoreBridge
from offload.null_bridge import NullRestores

# How deep into the waiting queue restores are started each step (each costs a lookup check).
RESTORE_SCAN_DEPTH = 8
# While the device runs a step, how long at most the step thread waits for lookup replies of
# waiting sequences (and only while the device is still busy: that time is otherwise idle).
MAX_DURING_STEP_LOOKUP_WAIT_S = 0.02


@dataclass
class ScheduledBatch:
    """The sequences of one step and how many new tokens each computes, in batch order."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class _Step:
    """One ``schedule`` call's working state: the batch, the budget left, what happened."""

    def __init__(self, budget: int) -> None:
        self.batch = ScheduledBatch()
        self.budget = budget
        self.preempted = False  # someone was preempted: nobody is admitted this step
        self.stopped = False  # a sequence preempted itself: no blocks left to grow anyone
        self.admitting = True  # the waiting head may still be admitted
        self._ids: set[int] = set()

    def has(self, seq: Sequence) -> bool:
        return id(seq) in self._ids

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.batch.add(seq, num_new_tokens)
        self._ids.add(id(seq))
        self.budget -= num_new_tokens


class Scheduler:
    """Owns the waiting and running queues; the only caller of the block manager's allocations."""

    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
        prefill_order: PrefillOrder | None = None, restores: RestoreBridge | None = None,
    ) -> None:
        """``restores``: the store's restores (``--kv-offload``); by default none (a null
        bridge: every sequence is admitted without the store)."""
        self.block_manager = block_manager
        block_manager.count_owed_with(self._owed_blocks)
        self.restores = restores if restores is not None else NullRestores(Counter())
        self.prefill_order = prefill_order or PrefillOrder()
        self.num_steps = 0  # schedule() calls so far: the clock of the aging rule
        self._head_blocked = False  # the waiting head did not fit in the free blocks
        self._restores_open = False  # the last schedule preempted nobody: restores may start
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_prompt_tokens = 0

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in the engine")
        seq.status = SequenceStatus.WAITING
        seq.ready_since_step = self.num_steps
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)
        # Its lookup goes out now, usually answered by admission; a likely hit is restored at
        # once, its load riding on the lookup, when a restore may start now (see
        # ``_start_restores``). Without prefix reads it computes its whole prompt.
        if seq.reads_prefix_cache and self.restores.prefetch(
                seq, busy=bool(self.running), may_restore=self._may_restore_on_arrival()):
            self.waiting.pop()
            seq.status = SequenceStatus.LOADING

    def _owed_blocks(self) -> int:
        """The blocks the running sequences still need for the tokens they have beyond the
        blocks they hold (``BlockManager.owed_to_running``)."""
        bs = self.block_manager.block_size
        return sum(max(0, -(-s.num_tokens // bs) - len(s.block_ids)) for s in self.running)

    def _may_restore_on_arrival(self) -> bool:
        """A restore of the request just queued may start now: the last schedule preempted
        nobody, the queue ahead of it is within the restore scan and not blocked, no restore
        waits for blocks, and a sequence's place is free."""
        return (self._restores_open and not self._head_blocked
                and len(self.waiting) <= RESTORE_SCAN_DEPTH
                and not self.restores.num_waiting_for_blocks
                and len(self.running) + self.restores.num_loading < self.max_num_seqs)

    def has_unfinished(self) -> bool:
        return bool(self._by_id)

    @property
    def num_loading(self) -> int:
        return self.restores.num_loading

    def _absorb_restores(self) -> None:
        """Loaded sequences start running after their restored prefix; the rest queue again."""
        ready, requeue = self.restores.poll()
        for seq in ready:
            seq.status = SequenceStatus.RUNNING
            seq.ready_since_step = self.num_steps
            self.running.append(seq)
            self._count_admission(seq, seq.num_computed_tokens)
        for seq in reversed(requeue):
            seq.status = SequenceStatus.WAITING
            seq.ready_since_step = min(seq.ready_since_step, self.num_steps)
            self.waiting.appendleft(seq)

    def _count_admission(self, seq: Sequence, num_hit_tokens: int) -> None:
        if seq.num_cached_tokens is None:  # first admission: count the prompt once
            # from the store ("hbm_peer": another engine's arena on this node); "hbm" is ours
            restored = dict(seq.restored_tokens_by_tier)
            num_local = num_hit_tokens - sum(restored.values())
            seq.num_cached_tokens = num_hit_tokens
            seq.cached_tokens_by_tier = {**restored, "hbm": num_local}
            self.num_prefix_query_tokens += seq.num_prompt_tokens
            self.num_prefix_hit_tokens += num_local
            self.num_prompt_tokens += seq.num_prompt_tokens

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences and allocate the blocks their new tokens need."""
        self._absorb_restores()
        step = _Step(self.max_num_batched_tokens)
        for seq in [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]:
            if step.budget <= 0 or step.stopped:
                break
            if seq.status is SequenceStatus.RUNNING:  # not preempted by an earlier decode
                self._schedule_running(step, seq, 1)
        self._schedule_prefills(step)
        self._restores_open = not step.preempted
        if self._restores_open:
            # Loads cost no budget: start them whatever the step holds, after this step's
            # chunks have their blocks (a restore reserves blocks too).
            self._start_restores()
        self.num_steps += 1
        return step.batch

    def start_restores_during_step(self, device_done: Callable[[], bool]) -> None:
        """While the device runs the step ``schedule`` returned: start the restores of
        waiting sequences near the head whose lookups are answered, waiting for those still
        on their way while ``device_done()`` is False (at most
        ``MAX_DURING_STEP_LOOKUP_WAIT_S``). Their loads then cross the bus during the step.
        The step's blocks are all held by its sequences, so reserving free ones is safe."""
        if not self._restores_open:
            return  # the step preempted: blocks are short, the next schedule decides
        depth = 1 if self._head_blocked else RESTORE_SCAN_DEPTH
        asking = [seq for seq in itertools.islice(self.waiting, depth)
                  if not seq.offload_checked and seq.reads_prefix_cache]
        if not asking:
            return
        answered = self.restores.answered_lookups(asking, lambda: not device_done(),
                                                  MAX_DURING_STEP_LOOKUP_WAIT_S)
        for seq in answered:
            if (self.restores.num_waiting_for_blocks
                    or len(self.running) + self.restores.num_loading >= self.max_num_seqs):
                return
            if self._try_restore(seq):
                self.waiting.remove(seq)

    def _schedule_prefills(self, step: _Step) -> None:
        """Running sequences with prompt left and the waiting queue's head, in the prefill
        order's priority (``engine/prefill_order.py``), while the budget lasts."""
        now = self.num_steps
        order = self.prefill_order
        candidates = sorted(
            (order.running_key(seq, i, now), i, seq) for i, seq in enumerate(self.running)
            if not step.has(seq))
        index = 0
        head_key = self._head_key(step)
        latency_bound = order.latency_chunk_tokens is not None and (
            self.num_loading > 0 or self._head_remaining() <= step.budget
            or any(s.num_tokens - s.num_computed_tokens <= step.budget
                   for _, _, s in candidates))
        while step.budget > 0 and not step.stopped:
            run_key = candidates[index][0] if index < len(candidates) else None
            if head_key is not None and (run_key is None or head_key < run_key):
                if not self._admit_head(step, latency_bound):
                    step.admitting = False
                head_key = self._head_key(step)
                continue
            if run_key is None:
                break
            seq = candidates[index][2]
            index += 1
            if seq.status is SequenceStatus.RUNNING and not step.has(seq):
                num_new = order.chunk(seq.num_tokens - seq.num_computed_tokens, step.budget,
                                      latency_bound)
                self._schedule_running(step, seq, num_new)

    def _schedule_running(self, step: _Step, seq: Sequence, num_new: int) -> None:
        """Grow ``seq`` by ``num_new`` tokens, preempting the most recently admitted running
        sequence not in the batch while blocks are short (``seq`` itself when none is left)."""
        while not self.block_manager.grow(seq, seq.num_computed_tokens + num_new):
            victim = next((s for s in reversed(self.running)
                           if s is not seq and not step.has(s)), seq)
            self.running.remove(victim)
            self._preempt(victim)
            step.preempted = True
            step.admitting = False
            if victim is seq:
                step.stopped = True  # nothing else can give blocks back this step
                return
        step.add(seq, num_new)
        seq.ready_since_step = self.num_steps + 1

    def _head_key(self, step: _Step) -> tuple[int, int, int] | None:
        """The priority key of the waiting head if it may be admitted now."""
        if not (step.admitting and self.waiting and len(self.running) < self.max_num_seqs):
            return None
        seq = self.waiting[0]
        restoring = self.restores.first_waiting_for_blocks
        if restoring is not None and restoring.arrival_time <= seq.arrival_time:
            # an earlier request's restore waits for blocks: nobody who came after overtakes
            # it (one that came before, waiting for the step's budget, goes first)
            return None
        hit_ids = self.block_manager.match_prefix(seq)
        num_hit_tokens = len(hit_ids) * self.block_manager.block_size
        return self.prefill_order.waiting_key(seq, num_hit_tokens, self.num_steps)

    def _head_remaining(self) -> int:
        """Prompt tokens the waiting head has past its HBM hit (a large number if none)."""
        if not self.waiting:
            return 1 << 62
        seq = self.waiting[0]
        return seq.num_tokens - len(self.block_manager.match_prefix(seq)) * \
            self.block_manager.block_size

    def _admit_head(self, step: _Step, latency_bound: bool) -> bool:
        """Admit the waiting head with its first chunk; False (nothing changed) if it does not
        fit or waits for the store."""
        bm = self.block_manager
        seq = self.waiting[0]
        if not seq.offload_checked and self._try_restore(seq):
            self.waiting.popleft()
            return True  # the head moved on
        hit_ids = bm.match_prefix(seq)  # again: chunks scheduled since may have evicted some
        num_hit_tokens = len(hit_ids) * bm.block_size
        num_new = self.prefill_order.chunk(seq.num_tokens - num_hit_tokens, step.budget,
                                           latency_bound)
        if not self.running:
            # Alone, it may take every block: shrink the chunk so progress is guaranteed.
            num_new = min(num_new, bm.admittable_tokens(hit_ids))
        if num_new <= 0 or not bm.admit(seq, hit_ids, num_new):
            self._head_blocked = True
            return False
        self._head_blocked = False
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._count_admission(seq, num_hit_tokens)
        step.add(seq, num_new)
        seq.ready_since_step = self.num_steps + 1
        return True

    def _start_restores(self) -> None:
        """Hand waiting sequences whose prefix the store may hold to the bridge, in arrival
        order, whether or not this step has budget left: a load costs no step tokens, and a
        restore issued now lands while others compute. Behind a head that lacks blocks only
        the head may reserve (a restore reserves blocks too)."""
        depth = 1 if self._head_blocked else RESTORE_SCAN_DEPTH
        for seq in list(itertools.islice(self.waiting, depth)):
            if (self.restores.num_waiting_for_blocks
                    or len(self.running) + self.restores.num_loading >= self.max_num_seqs):
                return
            if not seq.offload_checked and self._try_restore(seq):
                self.waiting.remove(seq)

    def _try_restore(self, seq: Sequence) -> bool:
        """True if the bridge now holds ``seq`` (LOADING; the caller takes it off the queue).
        Never for a sequence that owes prompt logprobs: it computes its prompt."""
        if not seq.reads_prefix_cache:
            return False
        hit_ids = self.block_manager.match_prefix(seq)
        if self.restores.start_restore(seq, len(hit_ids), bool(self.running)):
            seq.status = SequenceStatus.LOADING  # the offload bridge holds it until it lands
            return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.offload_checked = False  # its blocks may be in the store by now
        seq.num_saved_blocks = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def advance(self, batch: ScheduledBatch) -> None:
        """After the forward: the batch's new tokens are computed; cache newly full blocks."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_new
            self.block_manager.register_computed_blocks(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take the sequence out of the queues and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.restores.forget(seq)
        in_flight = seq.status is SequenceStatus.LOADING and self.restores.abort(seq)
        if not in_flight:  # else its blocks are freed when the store request ends
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._by_id.pop(seq.request_id, None)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish the request with reason "abort"; None if it is not in the engine."""
        seq = self._by_id.get(request_id)
        if seq is not None:
            self.finish(seq, FinishReason.ABORT)
        return seq
