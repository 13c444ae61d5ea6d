"""The verbs: what each control-protocol request does to the store, the registry and the leases.

Every method runs on a worker thread (the daemon's event loop never waits on the store) and gets a
``CallContext`` naming the connection that owns what the call creates. Leases and registrations
belong to one connection; when it closes, ``drop_owner`` releases and unmaps all of them. Copies
(save, load) check the context between blocks, so a cancelled call stops writing promptly.

With a cluster node (``--cluster``) blocks that save/put commit are advertised, blocks the store
drops for good are withdrawn, and a lookup or get that falls short locally asks the peers for the
rest: what arrives is stored here, leased like any local block, and reported as tier "remote".
A lookup runs on the event loop; only one that goes on to the peers is handed to a worker
(``Deferred``).

The HBM tier (``hbm_tier``): engines that share their block generations publish the blocks their
prefix caches hold (``resident``) and their evictions (``evicted``); a lookup from another engine
is then served by a copy between the two arenas where it can be, the store for the rest, under one
lease. Such a lease has the store's lease id when the store serves part of it, else an id from a
range the store never reaches.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import xxhash

from kvstore.engines import transfer as cuda_transfer
from kvstore.engines.hbm.tier import HbmHit, HbmTier
from kvstore.engines.registry import Registration, Registry, RegistryError
from kvstore.keys import Namespace, truncate_hash
from kvstore.store.block_store import (
    BlockStore,
    BlockUnavailable,
    Lease,
    LookupResult,
    StoreError,
    Tier,
)
from kvstore.wire import protocol as proto

if TYPE_CHECKING:  # imported only with --cluster: it pulls in redis and ucxx
    from kvstore.cluster.node import ClusterNode

log = logging.getLogger(__name__)

MAX_LEASE_TTL_S = 3600.0
# Leases the store has no part in (every block from the HBM tier) get ids from here up: the
# store's own ids count up from 1 and never get this far.
HBM_LEASE_IDS_FROM = 1 << 56


class ServiceError(Exception):
    """A request that failed in a way the client should see; ``code`` is a protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(eq=False)  # hashed by identity: the daemon keeps a set of running calls
class CallContext:
    """Who is calling and until when; ``cancel()`` asks a running copy to stop at the next block."""

    owner: str
    deadline: float  # time.monotonic() seconds
    on_loop: bool = False  # called on the event loop: waiting on peers must be deferred
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set() or time.monotonic() >= self.deadline

    def check(self) -> None:
        if self.cancelled:
            raise ServiceError("deadline_exceeded", "the request's deadline passed")


@dataclass(frozen=True)
class Deferred:
    """What an inline call returns when the rest must not run on the event loop (it waits on
    peers): the daemon calls ``run()`` on a worker thread, or ``abandon()`` if it never will."""

    run: Callable[[], Any]
    abandon: Callable[[], None]


@dataclass
class _LeaseEntry:
    """A lease a connection holds: the store's (``lease``), an HBM-tier hit (``hbm``), or both."""

    lease: Lease | None
    owner: str
    lease_id: int
    hbm: HbmHit | None = None
    expires_at: float = math.inf  # a lease without a store part expires here

    def stale(self, now: float) -> bool:
        if self.lease is not None:
            return self.lease.released or self.lease.expired(now)
        return now >= self.expires_at


class Service:
    """The daemon's verbs over one BlockStore; thread-safe."""

    def __init__(self, store: BlockStore, default_lease_ttl_s: float = 30.0,
                 debug_hash_bits: int | None = None, version: str = "",
                 cluster: ClusterNode | None = None) -> None:
        self.store = store
        self.cluster: ClusterNode | None = None
        self.registry = Registry()
        self.hbm = HbmTier(store, self.registry)  # takes registry.on_close
        self._hbm_lease_ids = itertools.count(HBM_LEASE_IDS_FROM)
        self.default_lease_ttl_s = default_lease_ttl_s
        self.debug_hash_bits = debug_hash_bits
        self.version = version
        self.started_at = time.monotonic()
        self._lock = threading.Lock()
        self._leases: dict[int, _LeaseEntry] = {}
        self._owners: set[str] = set()
        self._namespaces: dict[str, bytes] = {}
        self.requests = Counter()  # by verb
        self.errors = Counter()  # by code
        self.events = Counter()  # connections, leases expired, blocks saved/loaded...
        if cluster is not None:
            self.attach_cluster(cluster)

    def attach_cluster(self, cluster: ClusterNode) -> None:
        """Share the store through ``cluster`` (started by the caller, stopped by ``close()``
        before the store closes): advertise what is stored, withdraw what is dropped, fetch
        what lookups miss."""
        with self._lock:
            for name in _REMOTE_EVENTS:  # present from the start: exported series never appear
                self.events.setdefault(name, 0)
        if hasattr(self.store, "on_dropped"):  # TieredStore: blocks that left every tier
            self.store.on_dropped = cluster.on_evicted
        self.cluster = cluster

    # ------------------------------------------------------------------------- connections

    def open_owner(self, owner: str) -> None:
        with self._lock:
            self._owners.add(owner)
            self.events["connections_total"] += 1

    def drop_owner(self, owner: str) -> None:
        """The owner's connection closed: release its leases and unmap its registrations."""
        with self._lock:
            self._owners.discard(owner)
            entries = [e for e in self._leases.values() if e.owner == owner]
            for entry in entries:
                del self._leases[entry.lease_id]
            self.events["leases_dropped_on_disconnect"] += len(entries)
        for entry in entries:
            self._release_untracked(entry.lease)
        num_dropped = self.registry.drop_owner(owner)  # and their HBM-tier entries
        with self._lock:
            self.events["registrations_dropped_on_disconnect"] += num_dropped

    def count(self, verb: str, error_code: str | None) -> None:
        """Every request ends here exactly once: counted by verb, and by code if it failed."""
        with self._lock:
            self.requests[verb] += 1
            if error_code is not None:
                self.errors[error_code] += 1

    # ------------------------------------------------------------------------------ leases

    def _track(self, lease: Lease | None, owner: str, hbm: HbmHit | None = None,
               ttl_s: float = 0.0) -> int | None:
        """Hand the lease (and/or HBM hit) to ``owner``; its id, or None if the connection
        closed while the lookup ran (then it is released here)."""
        lease_id = lease.lease_id if lease is not None else next(self._hbm_lease_ids)
        entry = _LeaseEntry(lease, owner, lease_id, hbm, time.monotonic() + ttl_s)
        with self._lock:
            if owner in self._owners:
                self._leases[lease_id] = entry
                return lease_id
        self._release_untracked(lease)
        return None

    def _take_lease(self, lease_id: int, owner: str) -> _LeaseEntry:
        with self._lock:
            entry = self._leases.get(lease_id)
        if entry is None or entry.owner != owner:
            raise ServiceError("not_found", f"no lease {lease_id} on this connection (released, "
                                            "expired or never granted)")
        return entry

    def _drop_lease(self, lease_id: int) -> _LeaseEntry | None:
        with self._lock:
            entry = self._leases.pop(lease_id, None)
        if entry is None:
            return None
        self._release_untracked(entry.lease)
        return entry

    def release_abandoned(self, result: Any) -> None:
        """A lookup whose reply missed its deadline: nobody will use or release its lease."""
        if isinstance(result, dict) and result.get("lease_id") is not None:
            self._drop_lease(result["lease_id"])

    def expire_leases(self) -> int:
        """Release leases past their deadline, in the store and in the table; returns how many."""
        now = time.monotonic()
        num_expired = self.store.expire_leases(now)
        with self._lock:
            stale = [e for e in self._leases.values() if e.stale(now)]
            for entry in stale:
                del self._leases[entry.lease_id]
        for entry in stale:
            self._release_untracked(entry.lease)
        with self._lock:
            self.events["leases_expired"] += max(num_expired, len(stale))
        return len(stale)

    def num_leases(self, owner: str | None = None) -> int:
        with self._lock:
            return sum(1 for e in self._leases.values() if owner is None or e.owner == owner)

    # ------------------------------------------------------------------------------- verbs

    def call(self, verb: str, args: dict[str, Any], ctx: CallContext) -> Any:
        """Run one validated request; ServiceError carries the code the client sees."""
        ctx.check()
        return self._mapped(getattr(self, f"_verb_{verb}"), args, ctx)

    def _mapped(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except RegistryError as exc:
            raise ServiceError(exc.code, str(exc)) from None
        except StoreError as exc:
            raise ServiceError("store_error", str(exc) or type(exc).__name__) from None

    def _verb_health(self, args: dict, ctx: CallContext) -> dict:
        return self.health()

    def health(self) -> dict:
        return {"status": "ok", "uptime_s": round(time.monotonic() - self.started_at, 3),
                "pid": os.getpid(), "version": self.version}

    def _verb_stats(self, args: dict, ctx: CallContext) -> dict:
        return self.stats()

    def stats(self) -> dict:
        """The store's stats plus a ``daemon`` section of counters."""
        out = dict(self.store.stats())
        _add_tier_misses(out)
        with self._lock:
            daemon = {
                "uptime_s": round(time.monotonic() - self.started_at, 3),
                "connections": len(self._owners),
                "leases_active": len(self._leases),
                "requests": dict(self.requests),
                "errors": dict(self.errors),
                "events": dict(self.events),
            }
        daemon["registrations"] = len(self.registry)
        out["daemon"] = daemon
        if isinstance(out.get("tiers"), dict):
            out["tiers"]["hbm"] = self.hbm.stats()
        if self.cluster is not None:
            # Blocks served from peers, counted once per request (the store counts each of its
            # lookups: a request that went to the peers made two).
            if isinstance(out.get("tiers"), dict):
                out["tiers"]["remote"] = {"hits": daemon["events"]["blocks_hit_remote"],
                                          "misses": daemon["events"]["blocks_miss_remote"]}
            out["cluster"] = self.cluster.stats()
        return out

    def _bytes_key(self, namespace: str, key: bytes) -> tuple[bytes, bytes]:
        digest = self._namespaces.get(namespace)
        if digest is None:
            digest = Namespace(name=namespace).digest
            if len(self._namespaces) < 4096:
                self._namespaces[namespace] = digest
        return digest, truncate_hash(xxhash.xxh3_128_digest(key), self.debug_hash_bits)

    def _verb_put(self, args: dict, ctx: CallContext) -> dict:
        namespace, block_hash = self._bytes_key(args.get("namespace", "default"), args["key"])
        stored = self.store.put(namespace, block_hash, args["key"], args["value"])
        if stored and self.cluster is not None:
            self.cluster.on_stored(namespace, [block_hash])
        return {"stored": stored}

    def _verb_get(self, args: dict, ctx: CallContext) -> dict:
        namespace, block_hash = self._bytes_key(args.get("namespace", "default"), args["key"])
        result = self.store.lookup(namespace, [block_hash], [args["key"]],
                                   lease_ttl_s=self.default_lease_ttl_s, owner=ctx.owner)
        remote = False
        if result.lease is None and self._may_fetch(ctx):  # get runs on a worker: wait here
            result, num_fetched = self._fetch_remote(namespace, [block_hash], [args["key"]],
                                                     result, self.default_lease_ttl_s, ctx)
            remote = num_fetched > 0 and result.num_hit > 0
        if result.lease is None:
            return {"value": None, "tier": None}
        with result.lease as lease:
            try:
                value = bytes(self.store.read(lease, 0))
                self.store.done(lease, 0)
            except BlockUnavailable:
                return {"value": None, "tier": None}
        return {"value": value, "tier": Tier.REMOTE.value if remote else result.tiers[0].value}

    def _verb_lookup(self, args: dict, ctx: CallContext) -> dict | Deferred:
        ttl = args.get("lease_ttl_s")
        ttl = self.default_lease_ttl_s if ttl is None else min(float(ttl), MAX_LEASE_TTL_S)
        lease_ttl_s = ttl if ttl > 0 else None
        hashes, idents, packed = proto.lookup_items(args)  # a packed request gets runs back
        hbm = self.hbm.lookup(args["namespace"], hashes, idents, ctx.owner, lease_ttl_s)
        if hbm is not None:  # another engine holds some of it: no peers asked (see hbm_tier)
            return self._hbm_lookup_reply(hbm, ctx, lease_ttl_s, packed)
        result = self.store.lookup(args["namespace"], hashes, idents,
                                   lease_ttl_s=lease_ttl_s, owner=ctx.owner)
        if result.num_hit < len(hashes) and self._may_fetch(ctx):
            if ctx.on_loop:
                return Deferred(partial(self._mapped, self._lookup_remote, args["namespace"],
                                        hashes, idents, packed, ctx, result, lease_ttl_s),
                                partial(self._release_untracked, result.lease))
            return self._lookup_remote(args["namespace"], hashes, idents, packed, ctx, result,
                                       lease_ttl_s)
        return self._lookup_reply(result, ctx, packed=packed)

    def _lookup_remote(self, namespace: bytes, hashes: list, idents: list, packed: bool,
                       ctx: CallContext, local: LookupResult,
                       lease_ttl_s: float | None) -> dict:
        """On a worker: the local hit fell short; fetch what follows it from the peers."""
        num_local = local.num_hit
        result, num_fetched = self._fetch_remote(namespace, hashes, idents, local, lease_ttl_s,
                                                 ctx)
        remote = range(num_local, min(num_local + num_fetched, result.num_hit))
        return self._lookup_reply(result, ctx, remote, packed=packed)

    def _fetch_remote(self, namespace: bytes, hashes: list, idents: list, local: LookupResult,
                      lease_ttl_s: float | None, ctx: CallContext) -> tuple[LookupResult, int]:
        """Fetch blocks ``local.num_hit, ...`` from peers into the store and look up again, so
        the lease covers them: (the new result, how many blocks arrived). The local lease pins
        the local prefix until the new one does; peer trouble is a shorter hit, never an error.
        """
        assert self.cluster is not None
        num_local = local.num_hit
        num_fetched = 0
        try:
            if not ctx.cancelled:
                num_fetched = self.cluster.fetch_remote_prefix(namespace, hashes, idents,
                                                               start_index=num_local)
        except Exception:  # the cluster never fails a lookup: the hit just stays local
            log.exception("remote fetch failed")
        result = local
        if num_fetched:
            try:
                result = self.store.lookup(namespace, hashes, idents, lease_ttl_s=lease_ttl_s,
                                           owner=ctx.owner)
            finally:  # the new lease pins the local prefix now (or the lookup failed)
                self._release_untracked(local.lease)
        num_remote = max(0, min(num_local + num_fetched, result.num_hit) - num_local)
        with self._lock:
            self.events["lookups_remote"] += 1
            self.events["blocks_hit_remote"] += num_remote
            self.events["blocks_miss_remote"] += len(hashes) - num_local - num_remote
        return result, num_fetched

    def _may_fetch(self, ctx: CallContext) -> bool:
        """A cluster with another live node in view, and time left to ask it."""
        return self.cluster is not None and not ctx.cancelled and self.cluster.has_peers()

    def _release_untracked(self, lease: Lease | None) -> None:
        if lease is not None:
            self.store.release(lease)

    def _hbm_lookup_reply(self, hit: HbmHit, ctx: CallContext, lease_ttl_s: float | None,
                          packed: bool) -> dict:
        lease_id = None
        if hit.num_hit and lease_ttl_s is not None:
            lease_id = self._track(hit.lease, ctx.owner, hit, lease_ttl_s)
        else:
            self._release_untracked(hit.lease)
        result = LookupResult(hit.num_hit, hit.tiers, None)
        reply = self._lookup_reply(result, ctx, packed=packed)
        reply["lease_id"] = lease_id
        return reply

    def _lookup_reply(self, result: LookupResult, ctx: CallContext,
                      remote: range = range(0), packed: bool = False) -> dict:
        lease_id = None
        if result.lease is not None:
            lease_id = self._track(result.lease, ctx.owner)
        # Tier is a str enum and msgpack packs str subclasses as plain strings: no per-block
        # `.value` (enum attribute access costs ~0.2 us, 0.2 ms for 1,024 blocks). Exact strs
        # pack faster still (~15 us per 1,024), so a hit from one tier goes out as those.
        tiers = result.tiers
        if remote:  # the blocks this request fetched from peers: stored here now, but remote
            tiers = list(tiers)
            tiers[remote.start:remote.stop] = [Tier.REMOTE] * len(remote)
        if packed:  # run-length form: one [tier, count] per run, not one str per block
            return {"num_hit": result.num_hit, "tier_runs": proto.tier_runs(tiers),
                    "lease_id": lease_id}
        if tiers and tiers.count(tiers[0]) == len(tiers):
            tiers = [tiers[0].value] * len(tiers)
        return {"num_hit": result.num_hit, "tiers": list(tiers), "lease_id": lease_id}

    def _verb_release(self, args: dict, ctx: CallContext) -> dict:
        lease_id = args["lease_id"]
        with self._lock:
            entry = self._leases.get(lease_id)
            mine = entry is not None and entry.owner == ctx.owner
        return {"released": mine and self._drop_lease(lease_id) is not None}

    def _verb_remove(self, args: dict, ctx: CallContext) -> dict:
        removed = sum(bool(self.store.remove(args["namespace"], h)) for h in args["hashes"])
        return {"num_removed": removed}

    def _verb_register(self, args: dict, ctx: CallContext) -> dict:
        reg = self.registry.register(args["layout"], args["engine_id"], ctx.owner)
        return {"registration_id": reg.registration_id, "num_blocks": reg.num_blocks,
                "block_bytes": reg.block_bytes}

    def _verb_unregister(self, args: dict, ctx: CallContext) -> dict:
        return {"unregistered": self.registry.unregister(args["registration_id"], ctx.owner)}

    def _verb_save(self, args: dict, ctx: CallContext) -> dict:
        """Copy engine blocks into the store; each is published only after its copy finished."""
        reg = self.registry.get(args["registration_id"], ctx.owner)
        block_ids = args["block_ids"]
        reg.check_block_ids(block_ids)  # before anything is touched
        namespace, num_bytes = args["namespace"], reg.block_bytes
        outcomes: list[str] = []
        try:
            with reg.open_for_copy():
                if reg.is_cuda:  # pipelined D2H batches; see cuda_transfer
                    outcomes = cuda_transfer.save_blocks(self.store, reg, namespace, block_ids,
                                                         args["hashes"], args["idents"],
                                                         lambda: ctx.cancelled)
                else:
                    for block_id, block_hash, ident in zip(block_ids, args["hashes"],
                                                           args["idents"]):
                        ctx.check()
                        outcomes.append(self._save_one(reg, namespace, block_id, block_hash,
                                                       ident, num_bytes))
        finally:  # a save cut short by its deadline still advertises what it committed
            if self.cluster is not None and "saved" in outcomes:
                saved = [h for h, outcome in zip(args["hashes"], outcomes) if outcome == "saved"]
                self.cluster.on_stored(namespace, saved)
        counts = Counter(outcomes)
        with self._lock:
            self.events["blocks_saved"] += counts["saved"]
            self.events["blocks_save_duplicate"] += counts["duplicate"]
            self.events["blocks_save_failed"] += counts["failed"]
        return {"outcomes": outcomes, "num_saved": counts["saved"]}

    def _save_one(self, reg: Any, namespace: bytes, block_id: int, block_hash: bytes,
                  ident: bytes, num_bytes: int) -> str:
        try:
            slot = self.store.begin_write(namespace, block_hash, ident, num_bytes)
        except StoreError:
            return "failed"
        if slot is None:
            return "duplicate"
        try:
            reg.read_block(block_id, slot.buffer[:num_bytes])
        except BaseException:
            slot.abort()
            raise
        return "saved" if slot.commit() else "duplicate"

    def _verb_load(self, args: dict, ctx: CallContext) -> dict:
        """Copy leased blocks into engine blocks; stops at the first unavailable block (fail
        closed: ``num_loaded`` counts only blocks whose bytes fully arrived). Consumes the lease."""
        reg = self.registry.get(args["registration_id"], ctx.owner)
        entry = self._take_lease(args["lease_id"], ctx.owner)
        block_ids = args["block_ids"]
        num_leased = entry.hbm.num_hit if entry.hbm is not None else \
            len(entry.lease.block_hashes)
        if len(block_ids) > num_leased:
            raise ServiceError("bad_request", f"load: {len(block_ids)} block ids for a lease of "
                                              f"{num_leased} blocks")
        reg.check_block_ids(block_ids)
        num_loaded = 0
        try:
            with reg.open_for_copy():
                if entry.hbm is None:
                    num_loaded = self._load_from_store(reg, entry.lease, 0, block_ids, ctx)
                else:  # runs from other engines' arenas and from the store, in order
                    num_loaded = self.hbm.load(
                        entry.hbm, reg, block_ids,
                        partial(self._load_from_store, reg, entry.lease, ctx=ctx),
                        lambda: ctx.cancelled)
        finally:
            self._drop_lease(args["lease_id"])
            with self._lock:
                self.events["blocks_loaded"] += num_loaded
                self.events["blocks_load_short"] += len(block_ids) - num_loaded
        return {"num_loaded": num_loaded}

    def _load_from_store(self, reg: Registration, lease: Lease | None, first_index: int,
                         block_ids: list[int], ctx: CallContext) -> int:
        """Copy the lease's blocks ``first_index, ...`` into ``block_ids``; how many arrived."""
        if lease is None:
            return 0
        if reg.is_cuda:  # pipelined H2D batches; see cuda_transfer
            return cuda_transfer.load_blocks(self.store, reg, lease, block_ids,
                                             lambda: ctx.cancelled, first_index=first_index)
        num_loaded = 0
        for index, block_id in enumerate(block_ids, first_index):
            ctx.check()
            try:
                data = self.store.read(lease, index)
            except StoreError:  # BlockUnavailable included: the hit shrinks here
                break
            if data.nbytes != reg.block_bytes:
                break  # stored under another layout; never copy a partial block
            reg.write_block(block_id, data)  # returns once the copy is done
            self.store.done(lease, index)  # its DRAM may go to the next promotion
            num_loaded += 1
        return num_loaded

    def _verb_evicted(self, args: dict, ctx: CallContext) -> dict:
        """The engine dropped these blocks from its HBM: they leave the HBM tier's index."""
        if args.get("registration_id") is not None:
            regs = [self.registry.get(args["registration_id"], ctx.owner)]
        else:
            regs = self.registry.of_owner(ctx.owner)
        num_withdrawn = self.hbm.withdraw(regs, args["namespace"], args["hashes"])
        with self._lock:
            self.events["blocks_evicted_by_engines"] += len(args["hashes"])
        return {"num_acknowledged": len(args["hashes"]), "num_withdrawn": num_withdrawn}

    def _verb_resident(self, args: dict, ctx: CallContext) -> dict:
        """The engine holds these full blocks at these ids, as of these generations: the HBM
        tier may serve them to other engines (after checking each generation again)."""
        reg = self.registry.get(args["registration_id"], ctx.owner)
        if not reg.has_generations:
            raise ServiceError("bad_request", "resident: the registration shares no block "
                                              "generations (layout.generations)")
        reg.check_block_ids(args["block_ids"])
        num_indexed = self.hbm.publish(reg, args["namespace"], args["block_ids"], args["hashes"],
                                       args["idents"], args["generations"])
        with self._lock:
            self.events["blocks_published_resident"] += len(args["block_ids"])
        return {"num_indexed": num_indexed}

    def close(self) -> None:
        """Stop the cluster node (peers stop reading the store), release every lease."""
        if self.cluster is not None:
            if hasattr(self.store, "on_dropped"):
                self.store.on_dropped = None
            try:
                self.cluster.stop()
            except Exception:  # the leases below and the store's close must still happen
                log.exception("stopping the cluster node failed")
        with self._lock:
            entries = list(self._leases.values())
            self._leases.clear()
        for entry in entries:
            self._release_untracked(entry.lease)
        self.registry.close_all()


_REMOTE_EVENTS = ("lookups_remote", "blocks_hit_remote", "blocks_miss_remote")


def _add_tier_misses(stats: dict) -> None:
    """Per-tier misses where the store reports only per-tier hits and one miss total.

    Tiers are asked in order (DRAM, then SSD): a block a tier did not have fell through it, so
    DRAM misses = SSD hits + final misses, and SSD misses = final misses (SSD on) or 0.
    """
    tiers, counters = stats.get("tiers"), stats.get("counters") or {}
    if not isinstance(tiers, dict) or "miss_blocks" not in counters:
        return
    final = counters["miss_blocks"]
    ssd = tiers.get("ssd") if isinstance(tiers.get("ssd"), dict) else None
    ssd_on = bool(ssd and ssd.get("enabled", True) and ssd.get("capacity_bytes"))
    if isinstance(tiers.get("dram"), dict):
        ssd_hits = ssd.get("hits", 0) if ssd else 0
        tiers["dram"].setdefault("misses", ssd_hits + final)
    if ssd is not None:
        ssd.setdefault("misses", final if ssd_on else 0)
