"""The HBM tier: serve blocks resident in other registered engines by a copy between arenas.

A lookup first asks the index (``HbmIndex``) which blocks another engine of a compatible
registration holds, then asks the store (DRAM, SSD) for the others, in one lease: per block the
HBM copy is preferred (on GPU a device-to-device copy beats any host-to-device one). The hit is
the longest prefix every block of which one of them serves. A load walks the hit in runs of one
source: HBM runs go through ``copy.py`` (generation-checked), store runs through the caller's
store path; the first short run ends the count (fail closed). An HBM run cut short because its
source engine reused or dropped a block (it had published it and saved it too: write-through)
goes on from the store where the store still holds those blocks, under a lease of its own.

Eligible sources for a requester (its connection's registrations): another connection's
registration that publishes generations, with the same block pieces, on the host for a host
requester, on the same or a peer-accessible device for a CUDA one. Without any usable entry the
lookup returns None and the caller's plain store path runs, untouched.

For a peer node (``stage``): blocks only an engine's arena holds are copied into the store by
``PeerStaging`` (``staging.py``). Hashes that left the index are told to the left listeners
(the cluster withdraws what the node no longer holds).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.engines.hbm import copy as hbm_copy
from kvstore.engines.hbm.index import HbmEntry, HbmIndex
from kvstore.engines.hbm.outcome import BlockOutcome
from kvstore.engines.hbm.staging import PeerStaging
from kvstore.engines.registry import Registration, Registry
from kvstore.listeners import Listeners
from kvstore.store.block_store import BlockStore, Lease, Tier

log = logging.getLogger(__name__)

# Counted outcomes, present from the start: hits and misses are blocks of lookups that found
# HBM candidates (a miss: a block of such a lookup the HBM tier did not serve); copies are
# submitted runs; the failures are the reasons a copy stopped short.
_FAILURES = {BlockOutcome.GENERATION: "generation_failures",
             BlockOutcome.OWNER_CLOSED: "owner_closed_failures",
             BlockOutcome.INCOMPATIBLE: "incompatible_failures",
             BlockOutcome.COPY_ERROR: "copy_errors", BlockOutcome.STOPPED: "copies_stopped"}
# Which path each copied block took: shared memory to shared memory (CPU engines), between two
# engines on one GPU, or device to device between two GPUs (NVLink / PCIe peer access).
_PATHS = ("blocks_copied_host", "blocks_copied_same_gpu", "blocks_copied_peer_gpu")

COUNTERS = ("lookups", "hits", "misses", "copies", "blocks_copied", *_PATHS,
            *_FAILURES.values(), "store_fallbacks", "blocks_from_store_instead",
            "store_fallbacks_missed", "store_fallback_errors")
# then the staging's (``staging.COUNTERS``). A run that stopped because its source engine
# reused or dropped a block goes on from the store where the store holds those blocks too
# (``store_fallbacks``: runs; ``blocks_from_store_instead``: the blocks that came so;
# ``store_fallbacks_missed``: the store had none of them; ``store_fallback_errors``: the
# fallback failed, and the load ends there as it would have without it).
_FALLS_BACK = frozenset({BlockOutcome.GENERATION, BlockOutcome.OWNER_CLOSED})
# The lease of such a fallback: taken and used up within one load.
_FALLBACK_LEASE_TTL_S = 30.0
# ``load``'s way to the store: (lease, its first index to read, the engine's blocks) -> copied.
LoadLease = Callable[[Lease, int, Sequence[int]], int]
LeftListener = Callable[[bytes, list[bytes]], None]


def _path(src: Registration, dst: Registration) -> str:
    """The counter of a block copied from ``src``'s arena into ``dst``'s."""
    if not dst.is_cuda:
        return "blocks_copied_host"
    return "blocks_copied_same_gpu" if src.device_id == dst.device_id \
        else "blocks_copied_peer_gpu"


@dataclass
class HbmHit:
    """A hit with HBM blocks in it: per block of the hit, its HBM source (or None) and its index
    in the store's ``lease`` (or None). ``lease`` is None when the store serves none of it or
    no lease was asked for."""

    num_hit: int
    tiers: list[Tier]
    lease: Lease | None
    sources: list[HbmEntry | None]
    store_index: list[int | None]


class HbmTier:
    """The index plus lookups and loads across it and the store, and the staging for peers;
    thread-safe."""

    def __init__(self, store: BlockStore, registry: Registry) -> None:
        self.store = store
        self.registry = registry
        self.index = HbmIndex()
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._left_listeners: Listeners[LeftListener] = Listeners("hashes that left the arenas")
        registry.add_close_listener(self._registration_closed)
        self.staging = PeerStaging(store, self.index, self._report_left)

    def add_left_listener(self, listener: LeftListener) -> None:
        """From now on, tell ``listener(namespace, hashes)`` (outside every lock) of hashes
        whose last entry left the index; they may be back already, or held by the store."""
        self._left_listeners.add(listener)

    def _report_left(self) -> None:
        for namespace, hashes in self.index.drain_left().items():
            self._left_listeners.tell(namespace, hashes)  # a failure never fails the caller

    def _registration_closed(self, reg: Registration) -> None:
        self.index.drop_registration(reg)
        self._report_left()

    # -- publications -----------------------------------------------------------------------

    def publish(self, reg: Registration, namespace: bytes, block_ids: Sequence[int],
                hashes: Sequence[bytes], idents: Sequence[bytes],
                generations: Sequence[int]) -> list[bytes]:
        """Index ``reg``'s resident blocks (ids checked by the caller); returns the hashes
        indexed (the blocks still current)."""
        try:
            return self.index.publish(reg, namespace, block_ids, hashes, idents, generations)
        finally:
            self._report_left()  # a block id republished under another hash

    def withdraw(self, regs: Sequence[Registration], namespace: bytes,
                 hashes: Sequence[bytes]) -> int:
        try:
            return self.index.withdraw(regs, namespace, hashes)
        finally:
            self._report_left()

    # -- lookups ----------------------------------------------------------------------------

    def lookup(self, namespace: bytes, hashes: Sequence[bytes], idents: Sequence[bytes],
               owner: str, lease_ttl_s: float | None) -> HbmHit | None:
        """The hit with HBM blocks in it, or None when no block has a usable HBM source (then
        nothing was asked of the store or counted)."""
        if not self.index.holds(namespace):  # the common case: one dict lookup, no lock
            return None
        targets = self.registry.of_owner(owner)
        if not targets:
            return None

        def usable(src: Registration) -> bool:
            return (src.owner != owner and src.has_generations and not src.closed
                    and any(hbm_copy.compatible(src, dst) for dst in targets))

        found = self.index.find(namespace, hashes, idents, usable)
        self._report_left()  # stale entries find dropped
        if found is None:
            return None
        rest = [i for i, entry in enumerate(found) if entry is None]
        result = None
        num_hit = len(hashes)
        if rest:
            result = self.store.lookup(namespace, [hashes[i] for i in rest],
                                       [idents[i] for i in rest], lease_ttl_s=lease_ttl_s,
                                       owner=owner)
            if result.num_hit < len(rest):
                num_hit = rest[result.num_hit]
        if result is None:  # all of it from other engines' arenas
            tiers, store_index, num_store = [Tier.HBM] * num_hit, [None] * num_hit, 0
        else:
            tiers, store_index, num_store = [], [], 0
            for entry in found[:num_hit]:
                if entry is None:
                    tiers.append(result.tiers[num_store])
                    store_index.append(num_store)
                    num_store += 1
                else:
                    tiers.append(Tier.HBM)
                    store_index.append(None)
        num_hbm = num_hit - num_store
        with self._lock:
            self.counters["lookups"] += 1
            self.counters["hits"] += num_hbm
            self.counters["misses"] += len(hashes) - num_hbm
        return HbmHit(num_hit, tiers, result.lease if result is not None else None,
                      found[:num_hit], store_index)

    def held_prefixes(self, namespace: bytes, hashes: Sequence[bytes],
                      idents: Sequence[bytes]) -> dict[int, int]:
        """Per registration id, the leading blocks of the chain resident in its arena (current
        and verified); nothing counted, leased or dropped: a probe for routers."""
        if not self.index.holds(namespace):
            return {}
        return self.index.held_prefixes(namespace, hashes, idents)

    # -- loads ------------------------------------------------------------------------------

    def load(self, hit: HbmHit, dst: Registration, block_ids: Sequence[int],
             load_lease: LoadLease, stopped: Callable[[], bool],
             after_copy: Callable[[int], None] | None = None) -> int:
        """Fill ``block_ids`` (a prefix of the hit) in order; returns how many, from the first,
        arrived intact. ``load_lease(lease, first_lease_index, block_ids)`` loads a store run
        of ``lease`` and returns its count (the hit's own lease, or a fallback's). Call inside
        ``dst.open_for_copy()``."""
        num_blocks = len(block_ids)
        num_loaded, i = 0, 0
        while i < num_blocks:
            from_hbm = hit.sources[i] is not None
            j = i + 1
            while j < num_blocks and (hit.sources[j] is not None) == from_hbm:
                j += 1
            if from_hbm:
                out = hbm_copy.copy_blocks(hit.sources[i:j], dst, block_ids[i:j], stopped,
                                           after_copy)
                got = out.num_copied
                if out.stale is not None:
                    self.index.discard(out.stale)
                    self._report_left()
                with self._lock:
                    self.counters["copies"] += 1
                    self.counters["blocks_copied"] += got
                    for src, num in Counter(e.reg for e in hit.sources[i:i + got]).items():
                        self.counters[_path(src, dst)] += num
                    if out.failure is not None:
                        self.counters[_FAILURES[out.failure]] += 1
                if out.failure in _FALLS_BACK and not stopped():
                    got += self._from_store_instead(hit.sources[i + got:j], dst,
                                                    block_ids[i + got:j], load_lease)
            elif hit.lease is None:
                got = 0
            else:
                got = load_lease(hit.lease, hit.store_index[i], block_ids[i:j])
            num_loaded += got
            if got < j - i:
                break
            i = j
        return num_loaded

    def _from_store_instead(self, entries: Sequence[HbmEntry | None], dst: Registration,
                            block_ids: Sequence[int], load_lease: LoadLease) -> int:
        """The blocks of a cut-short HBM run, from the store where it holds them (a lease of
        their own, used up here); how many arrived, from the first."""
        sources = [e for e in entries if e is not None]
        if not sources or len(sources) != len(entries):
            return 0
        first = sources[0]
        try:
            found = self.store.lookup(first.namespace, [e.block_hash for e in sources],
                                      [e.ident for e in sources],
                                      lease_ttl_s=_FALLBACK_LEASE_TTL_S, owner=dst.owner)
            if found.lease is None or not found.num_hit:
                with self._lock:
                    self.counters["store_fallbacks_missed"] += 1
                return 0
            try:
                got = load_lease(found.lease, 0, block_ids[:found.num_hit])
            finally:
                self.store.release(found.lease)
        except Exception as exc:  # the store closing, a copy error: the blocks before stand
            log.warning("loading a reused block's run from the store failed: %s", exc)
            with self._lock:
                self.counters["store_fallback_errors"] += 1
            return 0
        with self._lock:
            self.counters["store_fallbacks"] += 1
            self.counters["blocks_from_store_instead"] += got
        return got

    # -- staging for peers -------------------------------------------------------------------

    def stage(self, namespace: bytes, hashes: Sequence[bytes], idents: Sequence[bytes],
              start: int, deadline: float,
              after_copy: Callable[[int], None] | None = None) -> int:
        """Blocks ``start..`` of the chain that only arenas hold, into the store for a peer's
        fetch: ``PeerStaging.stage``."""
        return self.staging.stage(namespace, hashes, idents, start, deadline, after_copy)

    def stats(self) -> dict:
        """``tiers.hbm`` of the daemon's stats: resident blocks indexed, hits and misses, and
        the copy and index counters."""
        index = self.index.stats()
        with self._lock:
            counters = dict(self.counters)
        counters.update(self.staging.stats())
        counters.update({f"index_{k}": v for k, v in index["index"].items()})
        return {"blocks": index["blocks"], "registrations": index["registrations"],
                "hits": counters.pop("hits"), "misses": counters.pop("misses"),
                "counters": counters}
