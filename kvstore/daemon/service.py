"""The service: every verb the control protocol names, by an explicit table, over one store.

Every handler runs on a worker thread (the daemon's event loop never waits on the store) or, for
``inline`` verbs, on the loop itself, and gets a ``CallContext`` naming the connection that owns
what the call creates. Leases (``LeaseTable``) and registrations belong to one connection; when
it closes, ``drop_owner`` releases and unmaps all of them.

The handlers live with their nouns: ``block_verbs`` (put, get, lookup, locate, release, remove),
``engine_verbs`` (register, unregister, save, load, resident, evicted); ``cluster_link`` shares
the store with peers (``--cluster``) and ``stats`` merges the stats reply.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.daemon.block_verbs import MAX_LEASE_TTL_S, BlockVerbs
from kvstore.daemon.calls import (
    CallContext,
    Deferred,
    Handler,
    ServiceError,
    with_mapped_errors,
)
from kvstore.daemon.cluster_link import ClusterLink
from kvstore.daemon.counters import DaemonCounters
from kvstore.daemon.engine_verbs import EngineVerbs
from kvstore.daemon.latency import RequestLatency
from kvstore.daemon.lease_table import LeaseTable
from kvstore.daemon.stalls import Stalls
from kvstore.daemon.stats import merge_stats
from kvstore.engines.copy_settings import CopySettings
from kvstore.engines.hbm.tier import HbmTier
from kvstore.engines.registry import Registry
from kvstore.key_filter import KeyFilter, filter_bits
from kvstore.store.block_store import BlockStore
from kvstore.wire import protocol as proto

if TYPE_CHECKING:  # imported only with --cluster: it pulls in redis and ucxx
    from kvstore.cluster.node import ClusterNode

log = logging.getLogger(__name__)

__all__ = ["MAX_LEASE_TTL_S", "CallContext", "Deferred", "Service", "ServiceError"]


class Service:
    """The daemon's verbs over one BlockStore; thread-safe."""

    def __init__(self, store: BlockStore, default_lease_ttl_s: float = 30.0,
                 debug_hash_bits: int | None = None, version: str = "",
                 cluster: ClusterNode | None = None,
                 copy_settings: CopySettings = CopySettings(),
                 debug_corrupt_engine: str | None = None,
                 max_registered_connections: int | None = None,
                 key_filter: bool = True) -> None:
        """``copy_settings``: how registered GPU engines' blocks are copied (``--copy-*``);
        ``debug_corrupt_engine``: tests only; ``max_registered_connections``: see
        ``Registry``; ``key_filter``: keep one for engines (``--key-filter``)."""
        self.store = store
        self.registry = Registry(copy_settings, debug_corrupt_engine=debug_corrupt_engine,
                                 max_owners=max_registered_connections)
        self.hbm = HbmTier(store, self.registry)  # listens for closed registrations
        self.default_lease_ttl_s = default_lease_ttl_s
        self.version = version
        self.started_at = time.monotonic()
        self.counters = DaemonCounters()
        self.latency = RequestLatency()
        self.stalls = Stalls()  # the control loop's lateness and the collector's pauses
        self.leases = LeaseTable(store.release)
        # which hashes may be held, for engines to skip lookups sure to miss (opened by the
        # daemon beside its socket: ``open_key_filter``); not authoritative where a lookup can
        # find what no save added here (peers) or hashes are truncated
        tiers = store.stats()["tiers"]
        self.key_filter = KeyFilter(
            filter_bits(sum(int(t.get("capacity_bytes", 0)) for t in tiers.values())),
            authoritative=debug_hash_bits is None and cluster is None)
        self._key_filter_wanted = key_filter
        self._cluster = ClusterLink(store, self.hbm, self.counters)
        blocks = BlockVerbs(store, self.hbm, self.leases, self._cluster, default_lease_ttl_s,
                            debug_hash_bits)
        engines = EngineVerbs(store, self.registry, self.hbm, self.leases, self._cluster,
                              self.counters, blocks.lookup, self.key_filter)
        # Every verb of the protocol (wire/protocol.py SCHEMAS), by name: grep finds each.
        self.verbs: dict[str, Handler] = {
            "hello": lambda args, ctx: self.hello(args),
            "health": lambda args, ctx: self.health(),
            "stats": lambda args, ctx: self.stats(),
            "engines": lambda args, ctx: {"engines": self.registry.describe()},
            "put": blocks.put,
            "get": blocks.get,
            "lookup": blocks.lookup,
            "lookup_load": engines.lookup_load,
            "locate": blocks.locate,
            "release": blocks.release,
            "remove": blocks.remove,
            "register": engines.register,
            "unregister": engines.unregister,
            "save": engines.save,
            "load": engines.load,
            "evicted": engines.evicted,
            "resident": engines.resident,
        }
        if cluster is not None:
            self.attach_cluster(cluster)

    @property
    def cluster(self) -> ClusterNode | None:
        return self._cluster.node

    def attach_cluster(self, cluster: ClusterNode) -> None:
        """Share the store through ``cluster`` (started by the caller, stopped by ``close()``
        before the store closes): advertise what is stored, withdraw what is dropped, fetch
        what lookups miss."""
        self.key_filter.authoritative = False  # a peer's blocks are found through its index
        self._cluster.attach(cluster)

    def open_key_filter(self, path: Path, group_id: int | None = None) -> bool:
        """Create the key filter's file at ``path`` (readable by ``group_id`` too, the socket's
        group), filled with every block held now; False
        (logged) if it cannot be made: engines then ask about every prefix, as before. Not
        made with ``--key-filter off``."""
        if not self._key_filter_wanted:
            return False
        try:
            self.key_filter.open(path, self._held_hashes, group_id)
        except OSError as exc:
            log.warning("no key filter at %s (%s): engines will look up every prefix", path, exc)
            return False
        return True

    def _held_hashes(self) -> list[bytes]:
        """The hashes of every block the store and the HBM tier hold (the filter's rebuild)."""
        return self.store.held_hashes() + self.hbm.index.hashes()

    # ------------------------------------------------------------------------- connections

    def open_owner(self, owner: str) -> None:
        self.leases.open_owner(owner)
        self.counters.add(connections_total=1)

    def owner_leaving(self, owner: str) -> None:
        """The owner's connection closed; ``drop_owner`` follows once its copies stopped (a
        registration refused meanwhile over what the owner holds waits for that)."""
        self.registry.owner_leaving(owner)

    def drop_owner(self, owner: str) -> None:
        """The owner's connection closed: release its leases and unmap its registrations."""
        num_leases = self.leases.close_owner(owner)
        self.counters.add(leases_dropped_on_disconnect=num_leases)
        num_dropped = self.registry.drop_owner(owner)  # and their HBM-tier entries
        self.counters.add(registrations_dropped_on_disconnect=num_dropped)

    def count(self, verb: str, error_code: str | None, elapsed_s: float | None = None) -> None:
        """Every request ends here exactly once: counted by verb, and by code if it failed;
        `elapsed_s` (received to reply) feeds the latency histograms of lookup, load and save."""
        self.counters.count_request(verb, error_code)
        if elapsed_s is not None:
            self.latency.observe(verb, elapsed_s)

    # ------------------------------------------------------------------------------ leases

    def release_abandoned(self, result: Any) -> None:
        """A lookup whose reply missed its deadline: nobody will use or release its lease."""
        if isinstance(result, dict) and result.get("lease_id") is not None:
            self.leases.drop(result["lease_id"])

    def expire_leases(self) -> int:
        """Release leases past their deadline, in the store and in the table; returns how many."""
        now = time.monotonic()
        num_expired = self.store.expire_leases(now)
        num_stale = self.leases.expire(now)
        self.counters.add(leases_expired=max(num_expired, num_stale))
        return num_stale

    def num_leases(self, owner: str | None = None) -> int:
        return self.leases.count(owner)

    # ------------------------------------------------------------------------------- verbs

    def call(self, verb: str, args: dict[str, Any], ctx: CallContext) -> Any:
        """Run one validated request; ServiceError carries the code the client sees."""
        ctx.check()
        handler = self.verbs.get(verb)
        if handler is None:  # the protocol validated the verb: a table out of step with it
            raise ServiceError("unknown_verb", f"no handler for verb {verb!r}")
        return with_mapped_errors(handler, args, ctx)

    def hello(self, args: dict) -> dict:
        """A client's first request: its protocol version against ours (one major, or refused
        with both named)."""
        theirs = args["protocol"]
        try:
            same = proto.protocol_major(theirs) == proto.protocol_major(proto.PROTOCOL_VERSION)
        except ValueError as exc:
            raise ServiceError(proto.BAD_REQUEST, f"hello: {exc}") from None
        ours = f"protocol {proto.PROTOCOL_VERSION} (kvstore-tiered {self.version or 'unknown'})"
        if not same:
            client = args.get("client") or "a client"
            raise ServiceError(proto.PROTOCOL_MISMATCH,
                               f"{client} speaks kvstore protocol {theirs[:32]}; this daemon "
                               f"speaks {ours}: upgrade the older one (one major version on "
                               f"both sides)")
        reply = {"protocol": proto.PROTOCOL_VERSION,
                 "daemon": f"kvstore-tiered {self.version or 'unknown'}",
                 "mono": time.monotonic()}  # a client on this clock stamps its requests
        key_filter = self.key_filter.describe()
        if key_filter is not None:  # 1.5: where the filter is, and whether a miss is sure
            reply["key_filter"] = key_filter
        return reply

    def health(self) -> dict:
        """The ``health`` verb's answer: failing, with the reason, once the CUDA context is
        poisoned (no copy runs any more)."""
        cuda_reason = self.registry.cuda_fault.reason
        now = time.monotonic()
        # ``mono``: when it answered, on the daemon's CLOCK_MONOTONIC (a client on the same
        # clock tells a late answer from a late read of it)
        report = {"status": "failing" if cuda_reason else "ok",
                  "uptime_s": round(now - self.started_at, 3),
                  "pid": os.getpid(), "version": self.version, "mono": now}
        if cuda_reason:
            report["reason"] = f"CUDA context poisoned: {cuda_reason}"
        return report

    def stats(self) -> dict:
        """The store's stats plus a ``daemon`` section of counters."""
        store_stats = self.store.stats()
        counts = self.counters.snapshot()
        daemon = {
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "connections": self.leases.num_owners,
            "leases_active": self.leases.count(),
            **counts,
            "registrations": len(self.registry),
            "copies": self.registry.copier_counts(),
            "copy_ms": self.registry.copy_timing(),
            "request_ms": self.latency.summary(),
            "stalls": self.stalls.report(),
            "key_filter": self.key_filter.stats(),
        }
        return merge_stats(store_stats, daemon, self.hbm.stats(),
                           self._cluster.stats(counts["events"]))

    def close(self) -> None:
        """Stop the cluster node (peers stop reading the store), release every lease."""
        self._cluster.stop()
        self.leases.clear()
        self.registry.close_all()
        self.key_filter.close()
