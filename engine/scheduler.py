"""Decides what runs each step: continuous batching, chunked prefill, preemption by recompute.

A step has a token budget (``max_num_batched_tokens``). Running sequences go first, in admission
order: one token each when decoding, the next chunk of their prompt otherwise. When a running
sequence needs a block and none is free, the most recently admitted running sequence is preempted:
its blocks are freed (full ones stay in the prefix cache) and it goes back to the head of the
waiting queue to be recomputed. Then, if nothing was preempted, waiting sequences are admitted in
arrival order while budget, ``max_num_seqs`` and blocks allow, each starting after its verified
prefix-cache hit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus
from offload.bridge import StoreBridge


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


class Scheduler:
    """Owns the waiting and running queues; the only caller of the block manager's allocations."""

    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_prompt_tokens = 0
        self.offload: StoreBridge | None = None  # set by the engine with --kv-offload

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in the engine")
        seq.status = SequenceStatus.WAITING
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)
        if self.offload is not None:
            # the reply is usually in by the time seq is admitted
            self.offload.prefetch(seq, busy=bool(self.running))

    def has_unfinished(self) -> bool:
        return bool(self._by_id)

    @property
    def num_loading(self) -> int:
        return self.offload.num_loading if self.offload is not None else 0

    def _absorb_restores(self) -> None:
        """Loaded sequences start running after their restored prefix; the rest queue again."""
        assert self.offload is not None
        ready, requeue = self.offload.poll()
        for seq in ready:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._count_admission(seq, seq.num_computed_tokens)
        for seq in reversed(requeue):
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def _count_admission(self, seq: Sequence, num_hit_tokens: int) -> None:
        if seq.num_cached_tokens is None:  # first admission: count the prompt once
            seq.num_cached_tokens = num_hit_tokens
            self.num_prefix_query_tokens += seq.num_prompt_tokens
            self.num_prefix_hit_tokens += num_hit_tokens - sum(
                seq.restored_tokens_by_tier.values())
            self.num_prompt_tokens += seq.num_prompt_tokens

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences and allocate the blocks their new tokens need."""
        if self.offload is not None:
            self._absorb_restores()
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.grow(seq, seq.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            batch.add(seq, num_new)
            budget -= num_new
            index += 1
        if not preempted:
            self._admit_waiting(batch, budget)
        return batch

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        bm = self.block_manager
        if self.offload is not None and self.offload.num_waiting_for_blocks:
            return  # an earlier request's restore waits for blocks: nobody overtakes it
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit_ids = bm.match_prefix(seq)
            if (self.offload is not None and not seq.offload_checked
                    and self.offload.start_restore(seq, len(hit_ids), bool(self.running))):
                seq.status = SequenceStatus.LOADING
                self.waiting.popleft()  # the offload bridge holds it until it lands
                continue
            num_hit_tokens = len(hit_ids) * bm.block_size
            num_new = min(seq.num_tokens - num_hit_tokens, budget)
            if not self.running:
                # Alone, it may take every block: shrink the chunk so progress is guaranteed.
                num_new = min(num_new, bm.admittable_tokens(hit_ids))
            if num_new <= 0 or not bm.admit(seq, hit_ids, num_new):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._count_admission(seq, num_hit_tokens)
            batch.add(seq, num_new)
            budget -= num_new

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

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take the sequence out of the queues and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            if self.offload is not None:
                self.offload.forget(seq)
        in_flight = (seq.status is SequenceStatus.LOADING and self.offload is not None
                     and self.offload.abort(seq))
        if not in_flight:  # else its blocks are freed when the store request ends
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._by_id.pop(seq.request_id, None)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish the request with reason "abort"; None if it is not in the engine."""
        seq = self._by_id.get(request_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq
