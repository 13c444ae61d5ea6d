"""The engine verbs: ``register``/``unregister`` an engine's KV memory, ``save`` blocks from it,
``load`` leased blocks into it, ``lookup_load`` (a lookup whose hit is loaded at once), and
``resident``/``evicted`` for the HBM tier.

Copies (save, load) run inside the registration's ``open_for_copy`` and check the call's context
between blocks, so a cancelled call stops writing promptly. How the bytes move (memcpy from
shared memory, pipelined CUDA batches) is the registration's business.
"""

from __future__ import annotations

import time
from collections import Counter
from functools import partial

from kvstore.daemon.calls import CallContext, Deferred, Handler, ServiceError
from kvstore.daemon.cluster_link import ClusterLink
from kvstore.daemon.counters import DaemonCounters
from kvstore.daemon.lease_table import LeaseTable
from kvstore.engines.hbm.tier import HbmTier
from kvstore.engines.registration import Registration
from kvstore.engines.registry import Registry
from kvstore.key_filter import KeyFilter
from kvstore.store.block_store import BlockStore, Lease
from kvstore.tiers import Tier
from kvstore.wire import protocol as proto

# The tiers a ``lookup_load`` copies from without asking: a copy from them is what the engine
# would start anyway. A hit that reaches any other tier (SSD, a peer node) comes back leased and
# unloaded, for the engine to weigh against recomputing.
LOAD_AT_ONCE = frozenset({Tier.HBM, Tier.DRAM})
_LOAD_ARGS = ("registration_id", "block_ids", "min_blocks")


class EngineVerbs:
    """Verbs on registered engines; each handler takes (args, ctx) and returns the result."""

    def __init__(self, store: BlockStore, registry: Registry, hbm: HbmTier, leases: LeaseTable,
                 cluster: ClusterLink, counters: DaemonCounters, lookup: Handler,
                 key_filter: KeyFilter) -> None:
        """``lookup``: the ``lookup`` verb's handler (``lookup_load`` starts with it);
        ``key_filter``: told each hash a save or publication may make findable, before it
        can be found."""
        self._store = store
        self._lookup = lookup
        self._registry = registry
        self._hbm = hbm
        self._leases = leases
        self._cluster = cluster
        self._counters = counters
        self._key_filter = key_filter

    def register(self, args: dict, ctx: CallContext) -> dict:
        reg = self._registry.register(args["layout"], args["engine_id"], ctx.owner, ctx.fds)
        return {"registration_id": reg.registration_id, "num_blocks": reg.num_blocks,
                "block_bytes": reg.block_bytes}

    def unregister(self, args: dict, ctx: CallContext) -> dict:
        return {"unregistered": self._registry.unregister(args["registration_id"], ctx.owner)}

    def save(self, args: dict, ctx: CallContext) -> dict:
        """Copy engine blocks into the store; each is published only after its copy finished."""
        reg = self._registry.get(args["registration_id"], ctx.owner)
        block_ids = args["block_ids"]
        reg.check_block_ids(block_ids)  # before anything is touched
        namespace = args["namespace"]
        self._key_filter.add(args["hashes"])  # before any of them can be found
        outcomes: list[str] = []
        try:
            with reg.open_for_copy():
                reg.save_blocks(self._store, namespace, block_ids, args["hashes"],
                                args["idents"], ctx, outcomes)
        finally:  # a save cut short by its deadline still advertises what it committed
            if "saved" in outcomes:
                saved = [h for h, outcome in zip(args["hashes"], outcomes) if outcome == "saved"]
                self._cluster.on_stored(namespace, saved)
        counts = Counter(outcomes)
        self._counters.add(blocks_saved=counts["saved"],
                           blocks_save_duplicate=counts["duplicate"],
                           blocks_save_failed=counts["failed"])
        return {"outcomes": outcomes, "num_saved": counts["saved"]}

    def load(self, args: dict, ctx: CallContext) -> dict:
        """Copy leased blocks into engine blocks; stops at the first unavailable block (fail
        closed: ``num_loaded`` counts only blocks whose bytes fully arrived). Consumes the lease."""
        reg = self._registry.get(args["registration_id"], ctx.owner)
        granted = self._leases.get(args["lease_id"], ctx.owner)
        if granted is None:
            raise ServiceError("not_found", f"no lease {args['lease_id']} on this connection "
                                            "(released, expired or never granted)")
        block_ids = args["block_ids"]
        if len(block_ids) > granted.num_blocks:
            raise ServiceError("bad_request", f"load: {len(block_ids)} block ids for a lease of "
                                              f"{granted.num_blocks} blocks")
        reg.check_block_ids(block_ids)
        num_loaded = 0
        try:
            with reg.open_for_copy():
                if granted.hbm is None:
                    num_loaded = self._load_from_store(reg, ctx, granted.store_lease, 0,
                                                       block_ids)
                else:  # runs from other engines' arenas and from the store, in order
                    num_loaded = self._hbm.load(granted.hbm, reg, block_ids,
                                                partial(self._load_from_store, reg, ctx),
                                                lambda: ctx.cancelled)
        finally:
            self._leases.drop(args["lease_id"])
            self._counters.add(blocks_loaded=num_loaded,
                               blocks_load_short=len(block_ids) - num_loaded)
        return {"num_loaded": num_loaded}

    def lookup_load(self, args: dict, ctx: CallContext) -> dict:
        """``lookup``, then ``load`` of the hit into ``block_ids`` (one engine block per hash
        asked) when the whole hit is in ``LOAD_AT_ONCE`` tiers and at least ``min_blocks``
        (default 1) long: one round trip instead of two, for a hit the engine expects. The
        reply is the lookup's plus ``num_loaded``: a count (the lease was used up, ``lease_id``
        is nil), or nil when nothing was loaded (the lease, if any, is the engine's to load
        with or release)."""
        reg = self._registry.get(args["registration_id"], ctx.owner)
        block_ids = args["block_ids"]
        chain = {name: value for name, value in args.items() if name not in _LOAD_ARGS}
        num_asked = len(proto.lookup_items(chain)[0])
        if len(block_ids) != num_asked:
            raise ServiceError("bad_request", f"lookup_load: {len(block_ids)} block ids for "
                                              f"{num_asked} hashes")
        reg.check_block_ids(block_ids)  # before anything is leased
        started = time.monotonic()
        reply = self._lookup(chain, ctx)
        looked_up = time.monotonic()
        if isinstance(reply, Deferred):  # only an inline lookup defers; this runs on a worker
            raise ServiceError("internal", "lookup_load: the lookup was deferred")
        num_hit, lease_id = int(reply["num_hit"]), reply["lease_id"]
        tiers = ({tier for tier, _ in reply["tier_runs"]} if "tier_runs" in reply
                 else set(reply["tiers"][:num_hit]))
        loads = (lease_id is not None and num_hit >= max(1, args.get("min_blocks", 1))
                 and {Tier(tier) for tier in tiers} <= LOAD_AT_ONCE)
        reply["num_loaded"] = None
        if loads:
            try:
                loaded = self.load({"registration_id": args["registration_id"],
                                    "lease_id": lease_id, "block_ids": block_ids[:num_hit]}, ctx)
            finally:
                self._leases.drop(lease_id)  # used up, or refused (registration gone): freed
            reply["lease_id"], reply["num_loaded"] = None, loaded["num_loaded"]
            # Where a loaded one's time goes, in µs: its lookup (lease included), its load.
            self._counters.add(lookup_load_us_lookup=round(1e6 * (looked_up - started)),
                               lookup_load_us_load=round(1e6 * (time.monotonic() - looked_up)))
        self._counters.add(lookup_loads_loaded=int(loads), lookup_loads_leased=int(not loads))
        return reply

    def _load_from_store(self, reg: Registration, ctx: CallContext, lease: Lease | None,
                         first_index: int, block_ids: list[int]) -> int:
        """Copy the lease's blocks ``first_index, ...`` into ``block_ids``; how many arrived."""
        if lease is None:
            return 0
        with self._store.reading(lease):  # no expiry or release under the copies in flight
            return reg.load_blocks(self._store, lease, first_index, block_ids, ctx)

    def evicted(self, args: dict, ctx: CallContext) -> dict:
        """The engine dropped these blocks from its HBM: they leave the HBM tier's index."""
        if args.get("registration_id") is not None:
            regs = [self._registry.get(args["registration_id"], ctx.owner)]
        else:
            regs = self._registry.of_owner(ctx.owner)
        num_withdrawn = self._hbm.withdraw(regs, args["namespace"], args["hashes"])
        self._counters.add(blocks_evicted_by_engines=len(args["hashes"]))
        return {"num_acknowledged": len(args["hashes"]), "num_withdrawn": num_withdrawn}

    def resident(self, args: dict, ctx: CallContext) -> dict:
        """The engine holds these full blocks at these ids, as of these generations: the HBM
        tier may serve them to other engines (after checking each generation again)."""
        reg = self._registry.get(args["registration_id"], ctx.owner)
        if not reg.has_generations:
            raise ServiceError("bad_request", "resident: the registration shares no block "
                                              "generations (layout.generations)")
        reg.check_block_ids(args["block_ids"])
        self._key_filter.add(args["hashes"])  # before any of them can be found
        indexed = self._hbm.publish(reg, args["namespace"], args["block_ids"], args["hashes"],
                                    args["idents"], args["generations"])
        self._cluster.on_stored(args["namespace"], indexed)  # peers may fetch them (staged)
        self._counters.add(blocks_published_resident=len(args["block_ids"]))
        return {"num_indexed": len(indexed)}
