"""The service's side of the cluster: advertising stored blocks, fetching missed ones from peers.

Without ``--cluster`` there is no node and every method here is a no-op (or says no). With one,
blocks that save/put commit and blocks engines publish as resident in their arenas (the HBM
tier) are advertised, and a lookup or get that falls short locally asks the peers for the rest:
what arrives is stored here and leased like any local block. A peer asking for blocks only an
arena holds gets them staged into the store first (``HbmTier.stage``). A block is withdrawn once
it left the node: the store dropped it and no arena holds it, or the other way round.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvstore.daemon.calls import CallContext
from kvstore.daemon.counters import DaemonCounters
from kvstore.engines.hbm.tier import HbmTier
from kvstore.store.block_store import BlockStore, LookupResult

if TYPE_CHECKING:  # imported only with --cluster: it pulls in redis and ucxx
    from kvstore.cluster.node import ClusterNode

log = logging.getLogger("kvstore.daemon.service")  # the service's logger, as before the split

REMOTE_EVENTS = ("lookups_remote", "blocks_hit_remote", "blocks_miss_remote")


class ClusterLink:
    """The cluster node this daemon shares its store through, if any."""

    def __init__(self, store: BlockStore, hbm: HbmTier, counters: DaemonCounters) -> None:
        self._store = store
        self._hbm = hbm
        self._counters = counters
        self.node: ClusterNode | None = None

    def attach(self, node: ClusterNode) -> None:
        """Share the store and the engines' arenas through ``node``: serve peers what either
        holds, withdraw what leaves both."""
        self._counters.declare(REMOTE_EVENTS)
        self.node = node
        self._store.add_drop_listener(self._left_store)
        self._hbm.add_left_listener(self._left_arenas)
        node.server.extend_with(self._hbm.stage)

    def _left_store(self, namespace: bytes, block_hashes: list[bytes]) -> None:
        """The store dropped these for good: withdraw those no engine's arena holds."""
        in_arenas = self._hbm.index.holding(namespace, block_hashes)
        self._withdraw(namespace, [h for h, held in zip(block_hashes, in_arenas) if not held])

    def _left_arenas(self, namespace: bytes, block_hashes: list[bytes]) -> None:
        """No engine's arena holds these any more: withdraw those the store does not hold."""
        in_arenas = self._hbm.index.holding(namespace, block_hashes)
        in_store = self._store.holding(namespace, block_hashes)
        self._withdraw(namespace, [h for h, a, s in zip(block_hashes, in_arenas, in_store)
                                   if not a and not s])

    def _withdraw(self, namespace: bytes, block_hashes: list[bytes]) -> None:
        if self.node is not None and block_hashes:
            self.node.on_evicted(namespace, block_hashes)

    def on_stored(self, namespace: bytes, block_hashes: list[bytes]) -> None:
        """Advertise blocks this daemon now holds."""
        if self.node is not None and block_hashes:
            self.node.on_stored(namespace, block_hashes)

    def may_fetch(self, ctx: CallContext) -> bool:
        """A cluster with another live node in view, and time left to ask it."""
        return self.node is not None and not ctx.cancelled and self.node.has_peers()

    def fetch(self, namespace: bytes, hashes: list, idents: list, local: LookupResult,
              lease_ttl_s: float | None, ctx: CallContext) -> tuple[LookupResult, int]:
        """Fetch blocks ``local.num_hit, ...`` from peers into the store and look up again, so
        the lease covers them: (the new result, how many blocks arrived). The local lease pins
        the local prefix until the new one does; peer trouble is a shorter hit, never an error.
        """
        assert self.node is not None
        num_local = local.num_hit
        num_fetched = 0
        try:
            if not ctx.cancelled:
                num_fetched = self.node.fetch_remote_prefix(namespace, hashes, idents,
                                                            start_index=num_local)
        except Exception:  # the cluster never fails a lookup: the hit just stays local
            log.exception("remote fetch failed")
        result = local
        if num_fetched:
            try:
                result = self._store.lookup(namespace, hashes, idents, lease_ttl_s=lease_ttl_s,
                                            owner=ctx.owner)
            finally:  # the new lease pins the local prefix now (or the lookup failed)
                if local.lease is not None:
                    self._store.release(local.lease)
        num_remote = max(0, min(num_local + num_fetched, result.num_hit) - num_local)
        self._counters.add(lookups_remote=1, blocks_hit_remote=num_remote,
                           blocks_miss_remote=len(hashes) - num_local - num_remote)
        return result, num_fetched

    def stats(self, events: dict[str, int]) -> tuple[dict, dict] | None:
        """(``tiers.remote``, ``cluster``) of the daemon's stats, or None without a cluster.
        Blocks served from peers are counted once per request (the store counts each of its
        lookups: a request that went to the peers made two)."""
        if self.node is None:
            return None
        remote = {"hits": events["blocks_hit_remote"], "misses": events["blocks_miss_remote"]}
        return remote, self.node.stats()

    def stop(self) -> None:
        """Stop the node (peers stop reading the store) before the store closes."""
        if self.node is None:
            return
        self._store.remove_drop_listener(self._left_store)
        try:
            self.node.stop()
        except Exception:  # the leases and the store's close must still happen
            log.exception("stopping the cluster node failed")
