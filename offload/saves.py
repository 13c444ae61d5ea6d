"""Saves: hand computed blocks to the store, pinned until it has their bytes.

Write-through saves every newly computed full block after its step; ``evict`` saves a cached
block once its last user let go, so the engine never reuses (evicts) a block the store does not
hold yet. Blocks are pinned inside the step (before a finished sequence frees them); requests are
built and sent after it, once the step's outputs are on their way. Acknowledged keys go to
``SavedKeys`` and are not saved again.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from offload.connector import OffloadConnector
from offload.engine_view import BlockLedger, OffloadSequence
from offload.idents import sequence_idents
from offload.saved_keys import SavedKeys
from offload.transfer import Transfer
from offload.vocab import ident_from_bytes

# Saves of at most this many blocks per request keep each round trip short.
SAVE_BATCH = 64


@dataclass
class SaveInFlight:
    transfer: Transfer
    block_ids: list[int]
    keys: list[bytes]


@dataclass
class QueuedSave:
    """Blocks pinned in a step, sent after it: the sequence, its block indices, their ids."""

    seq: OffloadSequence
    block_indices: list[int]
    block_ids: list[int]


class Saver:
    """Owns every save of one engine, queued or in flight (step thread only)."""

    def __init__(self, connector: OffloadConnector, ledger: BlockLedger,
                 saved_keys: SavedKeys, counters: Counter[str]) -> None:
        self.connector = connector
        self.ledger = ledger
        self.block_size = ledger.block_size
        self.saved_keys = saved_keys
        self.counters = counters
        self.in_flight: list[SaveInFlight] = []
        self.queued: list[QueuedSave] = []  # pinned, not yet sent

    def save_new_blocks(self, seq: OffloadSequence) -> None:
        """Write-through: pin the sequence's full blocks computed since its last save."""
        num_full = min(seq.num_computed_tokens // self.block_size, seq.num_registered_blocks)
        start = seq.num_saved_blocks
        if num_full <= start:
            return
        js = [j for j in range(start, num_full) if seq.block_hashes[j] not in self.saved_keys]
        seq.num_saved_blocks = num_full
        if not js or not self.connector.available:
            return
        # The ids are taken now: a sequence that finishes this step gives its blocks back.
        block_ids = [seq.block_ids[j] for j in js]
        self.ledger.pin(block_ids)
        self.queued.append(QueuedSave(seq, js, block_ids))

    def send_queued(self) -> None:
        queued, self.queued = self.queued, []
        for q in queued:
            seq = q.seq
            for i in range(0, len(q.block_indices), SAVE_BATCH):
                chunk, ids = q.block_indices[i:i + SAVE_BATCH], q.block_ids[i:i + SAVE_BATCH]
                if not self.connector.available:  # gone since: nothing will land, let them go
                    self.ledger.unpin(ids)
                    continue
                self._send(seq.namespace_digest, ids, [seq.block_hashes[j] for j in chunk],
                           sequence_idents(seq, chunk, self.block_size))

    def hand_over_released(self) -> None:
        """``evict``: save each cached block whose last user let go, pinned until stored."""
        by_namespace: dict[bytes, list[tuple[int, bytes, bytes]]] = {}
        for block_id, cached in self.ledger.drain_released():
            if cached.key in self.saved_keys:
                continue
            ident = ident_from_bytes(cached.parent_check, cached.token_bytes)
            by_namespace.setdefault(cached.namespace, []).append((block_id, cached.key, ident))
        for namespace, items in by_namespace.items():
            for i in range(0, len(items), SAVE_BATCH):
                chunk = items[i:i + SAVE_BATCH]
                block_ids = [c[0] for c in chunk]
                if not self.connector.available:
                    continue
                self.ledger.pin(block_ids)  # not reused before the store has the bytes
                self._send(namespace, block_ids, [c[1] for c in chunk], [c[2] for c in chunk])

    def _send(self, namespace: bytes, block_ids: list[int], keys: list[bytes],
              idents: list[bytes]) -> None:
        """The save request for blocks already pinned (unpinned when it ends)."""
        transfer = self.connector.save(namespace, block_ids, keys, idents)
        self.in_flight.append(SaveInFlight(transfer, block_ids, keys))
        self.counters["saves"] += 1

    def poll(self) -> None:
        """Account saves that ended: stored keys remembered, blocks unpinned."""
        still: list[SaveInFlight] = []
        for s in self.in_flight:
            if not s.transfer.poll():
                still.append(s)
                continue
            outcomes = s.transfer.result.outcomes if s.transfer.ok else None
            stored: list[bytes] = []
            for key, outcome in zip(s.keys, outcomes or ["failed"] * len(s.keys)):
                if outcome in ("saved", "duplicate"):
                    stored.append(key)
                    self.counters["blocks_saved"] += outcome == "saved"
                else:
                    self.counters["blocks_save_failed"] += 1
            self.saved_keys.add(stored)
            self.ledger.unpin(s.block_ids)
        self.in_flight = still

    def wait_idle(self, timeout_s: float) -> None:
        """Send what is queued, then block until saves end or ``timeout_s`` passes."""
        if self.queued:
            self.send_queued()
        deadline = time.monotonic() + timeout_s
        # A hung store answers nothing in time: waiting for it would only hold up the caller.
        while (self.in_flight and time.monotonic() < deadline
               and self.connector.state != "hung"):
            self.in_flight[0].transfer.wait(max(0.0, deadline - time.monotonic()))
            self.poll()
