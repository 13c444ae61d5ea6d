"""vLLM's KV events for the blocks the connector stores and sees go, as plain values: what the
KV-aware routers of Dynamo and llm-d read from vLLM's event publisher (the connector turns them
into vLLM's ``BlockStored`` / ``BlockRemoved``).

Blocks are named by vLLM's own block hashes (the request's, so these events and vLLM's GPU ones
name the same block), or by the store's where vLLM has none. A block is announced stored once a
worker reports that the daemon holds it (its save came back saved or duplicate): medium ``CPU``,
the daemon's DRAM. The connector sees the store only through its own requests, so that is where
it learns of changes: a lookup that finds a block in another place re-announces it there
(``STORAGE``: the daemon's SSD; locality ``REMOTE``: a peer daemon's copy), finds one it never
announced (stored by another instance on this daemon, which this instance can load too), or ends
at an announced block that is gone (removed). ``clear`` (vLLM's cache reset) removes everything
announced. A block nobody asks about again keeps its last announcement: events are hints, the
daemon's lookups stay the truth (as for vLLM's own cache).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum


class Medium(str, Enum):
    """vLLM's medium strings (``vllm.distributed.kv_events``)."""

    GPU = "GPU"
    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(str, Enum):
    """Relative to this vLLM instance: its node's daemon, or another node's."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


# Where a lookup's tier puts a block (the daemon's tier names).
TIER_PLACES: dict[str, tuple[Medium, Locality]] = {
    "dram": (Medium.CPU, Locality.LOCAL),
    "ssd": (Medium.STORAGE, Locality.LOCAL),
    "remote": (Medium.CPU, Locality.REMOTE),
    "hbm": (Medium.GPU, Locality.LOCAL),  # another engine's arena on this daemon
}
STORED_PLACE = TIER_PLACES["dram"]  # a save lands in the daemon's DRAM


@dataclass(frozen=True)
class BlockInfo:
    """One block as vLLM's events describe it."""

    block_hash: bytes  # vLLM's (or the store's) hash of the block
    parent_hash: bytes | None  # the previous block's, None for a request's first
    token_ids: tuple[int, ...]
    lora_name: str | None = None


@dataclass(frozen=True)
class BlocksStored:
    """Consecutive blocks of one chain, now held at ``medium``/``locality``."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str
    locality: str
    lora_name: str | None


@dataclass(frozen=True)
class BlocksRemoved:
    block_hashes: list[bytes]
    medium: str
    locality: str


BlockEvent = BlocksStored | BlocksRemoved


@dataclass
class BlockEvents:
    """What this connector has announced, by store hash, and the events not yet taken."""

    block_size: int
    max_announced: int = 100_000  # past it the oldest announcement is forgotten (no event)
    _announced: OrderedDict[bytes, tuple[bytes, tuple[Medium, Locality]]] = field(
        default_factory=OrderedDict)
    _pending: dict[bytes, BlockInfo] = field(default_factory=dict)  # saves not yet reported
    _pending_by_request: dict[str, list[bytes]] = field(default_factory=dict)
    _events: list[BlockEvent] = field(default_factory=list)

    def planned(self, request_id: str, store_hashes: Sequence[bytes],
                infos: Sequence[BlockInfo]) -> None:
        """Saves planned for these blocks: announced once a worker reports them stored."""
        for store_hash, info in zip(store_hashes, infos):
            self._pending[store_hash] = info
        self._pending_by_request.setdefault(request_id, []).extend(store_hashes)

    def saved(self, store_hashes: Sequence[bytes]) -> None:
        """The daemon holds these blocks (a worker's save outcomes): announce them."""
        infos = [(h, info) for h in store_hashes if (info := self._pending.pop(h, None))
                 and self._announced.get(h, (b"", None))[1] != STORED_PLACE]
        self._announce(infos, STORED_PLACE)

    def request_ended(self, request_id: str) -> None:
        """The request's saves all ended: what was not reported stored never will be."""
        for store_hash in self._pending_by_request.pop(request_id, ()):
            self._pending.pop(store_hash, None)

    def looked_up(self, store_hashes: Sequence[bytes], num_hit: int, tiers: Sequence[str],
                  info: Callable[[int], BlockInfo]) -> None:
        """A lookup of ``store_hashes`` found the first ``num_hit`` (``tiers`` says where);
        ``info(i)`` describes block ``i`` of them."""
        found: list[tuple[int, tuple[Medium, Locality]]] = []
        for i in range(min(num_hit, len(tiers))):
            place = TIER_PLACES.get(tiers[i])
            known = self._announced.get(store_hashes[i])
            if place is None or (known is not None and known[1] == place):
                continue
            if known is not None:  # moved: gone from where it was
                self._remove([store_hashes[i]])
            found.append((i, place))
        # Runs of consecutive blocks in one place become one event each.
        run: list[tuple[bytes, BlockInfo]] = []
        for n, (i, place) in enumerate(found):
            run.append((store_hashes[i], info(i)))
            last = n + 1 == len(found)
            if last or found[n + 1] != (i + 1, place):
                self._announce(run, place)
                run = []
        if num_hit < len(store_hashes) and store_hashes[num_hit] in self._announced:
            self._remove([store_hashes[num_hit]])  # the lookup ended at it: it is gone

    def clear(self) -> None:
        """Everything announced is removed (vLLM's cache reset)."""
        self._remove(list(self._announced))
        self._pending.clear()
        self._pending_by_request.clear()

    def take(self) -> list[BlockEvent]:
        """The events since the last call, in order."""
        events, self._events = self._events, []
        return events

    @property
    def num_announced(self) -> int:
        return len(self._announced)

    def _announce(self, blocks: list[tuple[bytes, BlockInfo]],
                  place: tuple[Medium, Locality]) -> None:
        """One event per chain of consecutive blocks (each one's parent is the previous)."""
        start = 0
        for n in range(1, len(blocks) + 1):
            if n < len(blocks) and blocks[n][1].parent_hash == blocks[n - 1][1].block_hash:
                continue
            chain = [info for _, info in blocks[start:n]]
            self._events.append(BlocksStored(
                block_hashes=[b.block_hash for b in chain], parent_block_hash=chain[0].parent_hash,
                token_ids=[t for b in chain for t in b.token_ids], block_size=self.block_size,
                medium=place[0].value, locality=place[1].value, lora_name=chain[0].lora_name))
            start = n
        for store_hash, info in blocks:
            self._announced[store_hash] = (info.block_hash, place)
            self._announced.move_to_end(store_hash)
        while len(self._announced) > self.max_announced:
            self._announced.popitem(last=False)

    def _remove(self, store_hashes: list[bytes]) -> None:
        """One event per place, in the order the blocks were announced."""
        by_place: dict[tuple[Medium, Locality], list[bytes]] = {}
        for store_hash in store_hashes:
            known = self._announced.pop(store_hash, None)
            if known is not None:
                by_place.setdefault(known[1], []).append(known[0])
        for place, hashes in by_place.items():
            self._events.append(BlocksRemoved(hashes, place[0].value, place[1].value))
