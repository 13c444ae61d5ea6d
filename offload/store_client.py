"""StoreClient: an engine's one client of the store: register its KV memory, look up, load, save,
publish evictions.

kvengine (``offload.engine_store``) and vLLM's connector (``offload.vllm``) both talk to the
daemon through this class, so a stopped, dead or slow daemon is handled the same way for both.

Everything here is asynchronous: each call queues a request for the ``LinkThread`` and returns a
``Transfer`` handle the step loop polls; no call waits on the daemon. A store that is down,
hung, slow or answering errors turns into misses, failed transfers and counted errors, never
into an exception or a stall in the step loop: the engine keeps serving by recompute, the link's
thread probes the daemon and reconnects (and re-registers) when it is back.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvstore import KeyFilterView, StoreState
from offload.link_requests import (
    EvictedRequest,
    LinkRequest,
    LoadRequest,
    LookupLoadRequest,
    LookupRequest,
    ReleaseRequest,
    ResidentRequest,
    SaveRequest,
)
from offload.link_thread import LinkThread, Outgoing
from offload.transfer import Transfer
from offload.vocab import KVLayout

log = logging.getLogger("offload")

# The daemon answers by its deadline (after its copy thread stopped); the engine waits this much
# longer before it calls a request lost, so a late "failed" reply is still seen as a reply.
_DEADLINE_MARGIN_S = 2.0

__all__ = ["StoreClient", "Transfer"]


class StoreClient:
    """Owns the link's thread to the store and the registration of one engine's KV arena."""

    def __init__(self, socket_path: str | Path | None,
                 layout: KVLayout | Callable[[], KVLayout] | None, engine_id: str,
                 timeout_s: float = 10.0, reconnect_interval_s: float = 1.0,
                 connect_wait_s: float | None = None, register_timeout_s: float | None = None,
                 on_registered: Callable[[], None] | None = None) -> None:
        """``layout``: what to register on every connect (see ``LinkThread``); None for a
        client that only looks up."""
        self.socket_path = socket_path
        self.layout = layout
        self.engine_id = engine_id
        self.timeout_s = timeout_s
        self.counters: Counter[str] = Counter()
        self._thread = LinkThread(socket_path, layout, engine_id, timeout_s, reconnect_interval_s,
                               self.counters, register_timeout_s=register_timeout_s,
                               on_registered=on_registered)
        self._last_state = StoreState.DOWN
        self._disowned: list[Transfer] = []  # lookups whose lease (if any) nobody will use
        # A healthy daemon registers us in milliseconds: serve with the store from the first
        # request. A hung one costs the caller at most the probe deadline.
        self._thread.wait_first_attempt(
            self._thread.probe_deadline_s if connect_wait_s is None else connect_wait_s)

    # ------------------------------------------------------------------------- connection

    @property
    def state(self) -> StoreState:
        """OK, HUNG or DOWN; changes are counted (``store_hung``, ``store_down``) and logged
        once each. Never blocks."""
        state = self._thread.state
        if state is not self._last_state:
            if state is not StoreState.OK:
                self.counters[f"store_{state.value}"] += 1
            if state is StoreState.HUNG:
                log.warning("kv offload: the store does not answer; recomputing until it does")
            elif state is StoreState.OK and self._last_state is StoreState.HUNG:
                log.warning("kv offload: the store answers again")
            self._last_state = state
        return state

    @property
    def live_state(self) -> StoreState:
        """``state`` for any thread (nothing counted)."""
        return self._thread.state

    @property
    def available(self) -> bool:
        """Registered and answering: worth starting a lookup or a save. When not connected, a
        reconnect is asked for (made off this thread)."""
        state = self.state
        if state is StoreState.DOWN:
            self._thread.want_connect()
        return state is StoreState.OK

    def wait_available(self, timeout_s: float) -> bool:
        """Give the first connect (and registration) up to ``timeout_s``, then say whether the
        store is available: startup only. A registration still running goes on meanwhile."""
        self._thread.wait_first_attempt(timeout_s)
        return self.available

    def keep_connected(self) -> None:
        """Not connected: have the link's thread reconnect (off this thread, rate-limited). The
        engine calls this every step; a bare client reconnects only when a request needs it."""
        if self.state is StoreState.DOWN:
            self._thread.want_connect()

    @property
    def registration_epoch(self) -> int:
        """Counts connections made (one registration each): a new one starts with nothing
        published and may be a daemon that lost what it held. Read it before taking block ids
        for a request and pass it as the request's ``epoch``."""
        return self._thread.epoch

    @property
    def daemon_pid(self) -> int | None:
        return self._thread.daemon_pid

    @property
    def key_filter(self) -> KeyFilterView | None:
        """The connected daemon's key filter (see ``kvstore/key_filter.py``): a hash it does
        not hold is in no tier, so its lookup need not be sent. None: ask about everything."""
        return self._thread.key_filter

    def daemon_knows(self, verb: str) -> bool:
        """Whether the daemon connected now has ``verb`` (by the protocol version it said in
        the hello): a verb a later minor added goes only to a daemon that speaks it. False
        while no daemon is connected."""
        return self._thread.daemon_knows(verb)

    def _lost(self, code: str) -> None:
        self.counters[f"errors_{code}"] += 1
        if code == "deadline":  # no reply at all: start over on a fresh connection
            self._thread.want_drop()

    def _request(self, request: LinkRequest, fallback: Any, deadline_s: float | None = None,
                 epoch: int | None = None) -> Transfer:
        """Queue a request; a hung store or a full queue completes it at once with
        ``fallback``. Not connected: the link's thread connects first (rate-limited). With
        ``epoch``, it goes out only on that connection (else it fails, never sent)."""
        deadline_s = self.timeout_s if deadline_s is None else deadline_s
        if self.state is StoreState.HUNG:
            self.counters["skipped_hung"] += 1
            return Transfer(0.0, fallback, self._lost, queued=False)
        transfer = Transfer(deadline_s + _DEADLINE_MARGIN_S, fallback, self._lost)
        if not self._thread.submit(Outgoing(request, transfer, epoch)):
            self.counters["skipped_queue_full"] += 1
            return Transfer(0.0, fallback, self._lost, queued=False)
        return transfer

    # ------------------------------------------------------------------------------ verbs

    def lookup(self, namespace: bytes, hashes: Sequence[bytes], idents: Sequence[bytes],
               lease_ttl_s: float = 30.0, deadline_s: float | None = None) -> Transfer:
        """Result: a ``LookupReply`` (num_hit, tiers, lease_id); a failure is None."""
        self.counters["lookups"] += 1
        return self._request(LookupRequest(namespace, list(hashes), list(idents), lease_ttl_s),
                             None, deadline_s)

    def lookup_load(self, namespace: bytes, hashes: Sequence[bytes], idents: Sequence[bytes],
                    block_ids: Sequence[int], lease_ttl_s: float = 30.0, min_blocks: int = 1,
                    deadline_s: float | None = None, epoch: int | None = None) -> Transfer:
        """A lookup whose hit the daemon loads at once into ``block_ids`` (one per hash; see
        ``kvstore.Client.lookup_load_async``). Result: a ``LookupReply`` whose ``num_loaded``
        says whether it loaded; a failure is None (with ``answered`` False and not
        ``never_sent``, the daemon may still write the blocks)."""
        self.counters["lookup_loads"] += 1
        request = LookupLoadRequest(namespace, list(hashes), list(idents), list(block_ids),
                                    lease_ttl_s, min_blocks, deadline_s)
        return self._request(request, None, deadline_s, epoch)

    def load(self, lease_id: int, block_ids: Sequence[int],
             deadline_s: float | None = None, epoch: int | None = None) -> Transfer:
        """Result: how many leading ``block_ids`` hold their block now; a failure is 0."""
        self.counters["loads"] += 1
        return self._request(LoadRequest(lease_id, list(block_ids), deadline_s), 0, deadline_s,
                             epoch)

    def save(self, namespace: bytes, block_ids: Sequence[int], hashes: Sequence[bytes],
             idents: Sequence[bytes], deadline_s: float | None = None,
             epoch: int | None = None) -> Transfer:
        """Result: a ``SaveReply`` (per-block outcomes "saved", "duplicate", "failed"); a
        failure is None."""
        self.counters["saves"] += 1
        request = SaveRequest(namespace, list(block_ids), list(hashes), list(idents),
                              deadline_s)
        return self._request(request, None, deadline_s, epoch)

    def release(self, lease_id: int) -> None:
        """Give a lease back without waiting for the reply."""
        self._request(ReleaseRequest(lease_id), None)

    def disown(self, lookup: Transfer) -> None:
        """Nobody will use this lookup's reply: its lease, if it gets one, is released once the
        reply is in (``release_disowned``)."""
        self._disowned.append(lookup)

    def release_disowned(self) -> None:
        """Release the leases of disowned lookups that have replied (call it every step); not
        while the store is hung (a release would be dropped): they wait until it answers."""
        if not self._disowned or self._thread.state is StoreState.HUNG:
            return
        still = []
        for lookup in self._disowned:
            if not lookup.poll():
                still.append(lookup)
            elif lookup.ok and lookup.result is not None and lookup.result.lease_id:
                self.release(lookup.result.lease_id)
        self._disowned = still

    def resident(self, namespace: bytes, block_ids: Sequence[int], hashes: Sequence[bytes],
                 idents: Sequence[bytes], generations: Sequence[int]) -> None:
        """Publish blocks held in the arena, as of their generations (the store's HBM tier),
        without waiting for the reply."""
        if not block_ids:
            return
        self.counters["resident_published"] += len(block_ids)
        self._request(ResidentRequest(namespace, list(block_ids), list(hashes), list(idents),
                                      list(generations)), None)

    def evicted(self, namespace: bytes, hashes: Sequence[bytes]) -> None:
        """Publish blocks the engine dropped from HBM, without waiting for the reply."""
        if not hashes:
            return
        self.counters["evictions_published"] += len(hashes)
        self._request(EvictedRequest(namespace, list(hashes)), None)

    def close(self) -> None:
        """Unregister (the daemon forgets this arena's resident blocks) and close; bounded."""
        self._thread.close()
