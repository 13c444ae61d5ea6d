"""EngineResidency: which blocks one vLLM engine holds in its GPU cache, keyed by our chain.

vLLM names its blocks by hashes seeded per process (they cannot be reproduced outside it), so
the router keys each stored block again, as llm-d's and Dynamo's routers do: by our own chain
over the block's token ids (``kvstore.keys.chain_hashes``), from the parent's key, the first
block of a chain from ``events_namespace(cache_salt)``. A request's prompt keyed the same way
then finds its leading run here (``held``). A block whose parent the router never saw (it
missed events, or the chain began before it subscribed) cannot be keyed: it is counted
(``unkeyed_blocks``) and left out, so the router under-counts, never over-counts, what an engine
holds, except after missed removals, which ``resync`` clears. Only GPU-medium events of the
first KV cache group count: a connector's CPU or STORAGE events are the daemon's tiers, which
the router asks the daemon about.

Updated by the event feed's thread, read on the router's event loop: one lock, held briefly.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence

from kvstore.keys import Namespace, chain_hashes, encode_tokens
from server.router.vllm_events import (
    GPU_MEDIUM,
    BlockKey,
    Cleared,
    Event,
    Removed,
    Stored,
    first_block_salt,
)

# The most blocks one engine's table keeps (an H200's vLLM holds under 100k of 16 tokens); the
# oldest go first. About 150 bytes each: 80 MB at most per engine.
MAX_BLOCKS = 1 << 19


def events_namespace(cache_salt: str, lora_name: str | None = None) -> bytes:
    """The root of the router's keys for vLLM's blocks of one tenant (``cache_salt``) and LoRA:
    the router's own, apart from every store namespace."""
    return Namespace(name="kvengine-router:vllm-events", tenant_salt=cache_salt,
                     lora_id=lora_name or "").digest


class EngineResidency:
    """One engine's GPU-resident blocks, from its KV events."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        self.block_size: int | None = None  # from the first event
        self._lock = threading.Lock()
        self._ours: OrderedDict[BlockKey, bytes] = OrderedDict()  # vLLM's hash -> our key
        self._held: Counter[bytes] = Counter()  # our keys (two vLLM hashes may share one)
        self.counters: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._held)

    def held(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a chain (our keys) the engine holds."""
        with self._lock:
            held = self._held
            for index, key in enumerate(hashes):
                if key not in held:
                    return index
            return len(hashes)

    def apply(self, events: Sequence[Event]) -> None:
        """One batch's events, in order."""
        with self._lock:
            for event in events:
                if isinstance(event, Stored):
                    self._stored(event)
                elif isinstance(event, Removed):
                    self._removed(event)
                elif isinstance(event, Cleared):
                    self._clear()
                    self.counters["clears"] += 1

    def resync(self) -> None:
        """Events were lost: forget everything (a smaller hit until the engine stores again)."""
        with self._lock:
            self._clear()
            self.counters["resyncs"] += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"blocks": len(self._held), **self.counters}

    def _clear(self) -> None:
        self._ours.clear()
        self._held.clear()

    @staticmethod
    def _ours_to_track(medium: str | None, group_idx: int | None) -> bool:
        return (medium is None or medium == GPU_MEDIUM) and not group_idx

    def _stored(self, event: Stored) -> None:
        if not self._ours_to_track(event.medium, event.group_idx):
            return
        num = len(event.block_hashes)
        if self.block_size is None:
            self.block_size = event.block_size
        elif event.block_size != self.block_size:
            self.counters["unkeyed_blocks"] += num  # not one engine's cache: ignore it
            return
        salt, keyable = first_block_salt(event)
        if event.parent_block_hash is None:  # a chain's first block: from the tenant's root
            parent: bytes | None = events_namespace(salt, event.lora_name)
        else:
            parent = self._ours.get(event.parent_block_hash)
        if not keyable or parent is None:
            self.counters["unkeyed_blocks"] += num
            return
        keys = chain_hashes(parent, encode_tokens(event.token_ids), event.block_size,
                            parent=parent)
        for theirs, ours in zip(event.block_hashes, keys, strict=True):
            old = self._ours.pop(theirs, None)
            if old is not None:
                self._drop(old)
            self._ours[theirs] = ours
            self._held[ours] += 1
        self.counters["stored_blocks"] += num
        while len(self._ours) > self.max_blocks:
            _, ours = self._ours.popitem(last=False)
            self._drop(ours)
            self.counters["dropped_blocks"] += 1

    def _removed(self, event: Removed) -> None:
        if not self._ours_to_track(event.medium, event.group_idx):
            return
        for theirs in event.block_hashes:
            ours = self._ours.pop(theirs, None)
            if ours is not None:
                self._drop(ours)
                self.counters["removed_blocks"] += 1

    def _drop(self, ours: bytes) -> None:
        left = self._held[ours] - 1
        if left > 0:
            self._held[ours] = left
        else:
            del self._held[ours]
