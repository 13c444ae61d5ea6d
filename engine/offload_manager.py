"""The engine side of ``--kv-offload``: restore prefixes from the store, save and publish blocks.

Per sequence: on arrival an async lookup for the blocks past the HBM prefix hit, so that the reply
is usually in when the scheduler reaches it (a step waits at most 2 ms in all for replies still
on their way: cheaper than the step the request would lose); on a hit worth
restoring (``RestorePolicy``) the blocks are reserved and an async load started; the sequence waits
in LOADING while others run; when the load lands, its blocks join the prefix cache and prefill
covers only the rest. A short or failed load shrinks the hit to what arrived. Saving: write-through
saves every newly computed full block after its step; ``evict`` hands blocks to the store before
the engine may reuse them. Every eviction is published. The step loop never waits on the store.

HBM tier (with ``generations``): after each step the blocks newly registered in the prefix cache
are published as resident (block id, hash, ident, generation), after the step's evictions, so
another engine on the same daemon can get them by a copy between the arenas; a reconnect
republishes every cached block. Restores report such blocks as tier "hbm".
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus
from kvstore.keys import ident_from_bytes
from kvstore.layout import KVLayout
from offload.block_generations import BlockGenerations
from offload.connector import OffloadConnector, Transfer
from offload.restore_policy import RestorePolicy

log = logging.getLogger("offload")

# Saves of at most this many blocks per request keep each round trip short.
_SAVE_BATCH = 64
# Resident publications are index updates only: larger batches.
_RESIDENT_BATCH = 1024
# A restore whose blocks cannot be reserved yet keeps its lease and retries every step for this
# long (well inside the lease's TTL), then gives up and recomputes.
_MAX_BLOCK_WAIT_S = 5.0
# The most one step spends waiting for lookup replies of requests it is admitting.
_LOOKUP_WAIT_PER_STEP_S = 0.002
# The least a restore costs (a round trip, maybe the bounded lookup wait): a lookup is sent only
# when recomputing its blocks is expected to take longer (and longer than a step, when busy).
_MIN_RESTORE_S = 0.002


@dataclass
class _Restore:
    """One sequence's restore in flight: the lookup, then (maybe) the load."""

    seq: Sequence
    first_block: int  # blocks before this were HBM hits
    lookup: Transfer
    load: Transfer | None = None
    tiers: list[str] = field(default_factory=list)
    num_blocks: int = 0  # blocks the load asked for
    lease_id: int | None = None
    num_hit: int = 0  # blocks the lookup found (0 until it answered)
    waiting_since: float | None = None  # when a reservation first failed for lack of blocks
    busy: bool = True  # other requests were running when it asked (a restore sits out a step)


@dataclass
class _Save:
    transfer: Transfer
    block_ids: list[int]
    keys: list[bytes]


class OffloadManager:
    """Owns every in-flight store request of one engine; called by the scheduler and the engine."""

    def __init__(self, connector: OffloadConnector, block_manager: BlockManager,
                 block_bytes: int, policy: str, restore_policy: RestorePolicy,
                 always_restore: bool = False,
                 generations: BlockGenerations | None = None) -> None:
        if policy not in ("write-through", "evict"):
            raise ValueError(f"unknown offload policy {policy!r}")
        self.connector = connector
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.block_bytes = block_bytes
        self.policy = policy
        self.restore_policy = restore_policy
        self.always_restore = always_restore  # benchmarks: measure a tier even when it loses
        self.counters: Counter[str] = Counter()
        self.hit_tokens_by_tier: Counter[str] = Counter()
        self._restores: dict[str, _Restore] = {}
        self._prefetched: dict[str, _Restore] = {}  # lookups sent on arrival, not yet used
        self._orphans: list[Transfer] = []  # lookups whose lease (if any) nobody will use
        self._lookup_wait_until = 0.0  # this step's bound on waiting for lookup replies
        self._saves: list[_Save] = []
        # pinned, not yet sent: (sequence, its block indices, their block ids)
        self._queued_saves: list[tuple[Sequence, list[int], list[int]]] = []
        self._saved_keys: dict[bytes, None] = {}  # hashes the store acknowledged (bounded)
        block_manager.track_released = policy == "evict"  # only that policy drains them
        # The HBM tier: the layout the connector registered names these generations.
        self.generations = generations
        self._published_epoch = -1  # the registration the resident blocks were published to
        if generations is not None:
            block_manager.generations = generations
            block_manager.track_resident = True

    # -- restore ----------------------------------------------------------------------------

    @property
    def num_loading(self) -> int:
        return len(self._restores)

    @property
    def num_waiting_for_blocks(self) -> int:
        """Restores with a hit whose blocks could not be reserved yet (the scheduler admits no
        one else meanwhile: first come, first served, as without the store)."""
        return sum(1 for r in self._restores.values()
                   if r.load is None and r.waiting_since is not None)

    def prefetch(self, seq: Sequence, busy: bool) -> None:
        """On arrival: send the lookup for the blocks past the HBM hit now, so that its reply
        is usually back by the time the scheduler reaches the request (``start_restore`` then
        goes on without waiting a step for it). ``busy``: other requests are running."""
        if seq.request_id in self._prefetched or seq.request_id in self._restores:
            return
        r = self._lookup(seq, len(self.bm.match_prefix(seq)), busy)
        if r is not None:
            self._prefetched[seq.request_id] = r
            self.counters["lookups_at_arrival"] += 1

    def forget(self, seq: Sequence) -> None:
        """The sequence left before its prefetched lookup was used: release what it holds."""
        r = self._prefetched.pop(seq.request_id, None)
        if r is not None:
            self._orphans.append(r.lookup)

    def start_restore(self, seq: Sequence, num_hbm_hit_blocks: int, busy: bool) -> bool:
        """Ask the store for the blocks past the HBM hit (or use the lookup sent on arrival);
        True if ``seq`` now waits on it (LOADING), False if it goes on without the store.
        ``busy``: other requests are running (a restore makes ``seq`` sit out this step)."""
        r = self._prefetched.pop(seq.request_id, None)
        if r is not None and r.first_block != num_hbm_hit_blocks:  # the HBM hit moved since
            self._orphans.append(r.lookup)
            self.counters["lookups_at_arrival_stale"] += 1
            r = None
        if r is None:
            r = self._lookup(seq, num_hbm_hit_blocks, busy)
            if r is None:
                return False
        r.busy = busy
        self._restores[seq.request_id] = r
        seq.status = SequenceStatus.LOADING
        if not r.lookup.poll():
            # A lookup reply takes well under a millisecond; waiting for it (bounded per step)
            # costs the running requests less than the step the new one would otherwise lose.
            # Loads and saves are never waited for.
            budget = self._lookup_wait_until - time.monotonic()
            if budget <= 0 or not r.lookup.wait(budget):
                self.counters["lookups_answered_late"] += 1
                return True  # the reply comes in a later step (poll)
        self.counters["lookups_answered_on_time"] += 1
        if self._begin_load(r):
            return True  # loading, or waiting for blocks
        del self._restores[seq.request_id]
        return False  # a miss or declined: admitted now, without the store

    def _lookup(self, seq: Sequence, first: int, busy: bool) -> _Restore | None:
        """Send the lookup of blocks ``first..`` (None: not worth asking, or no store)."""
        bs = self.block_size
        last = (seq.num_tokens - 1) // bs  # leave at least one token to compute
        if first >= last or not self.connector.available:
            return None
        # Not worth a round trip when even an instant load of every block asked for would lose
        # to recomputing them (a lookup reply may also cost a bounded wait in the step).
        if not self.always_restore and not self.restore_policy.restore_wins(
                _MIN_RESTORE_S, (last - first) * bs, busy):
            self.counters["lookups_skipped_small"] += 1
            seq.offload_checked = True
            return None
        hashes = seq.block_hashes[first:last]
        idents = self._idents(seq, range(first, last))
        lookup = self.connector.lookup(seq.namespace_digest, hashes, idents)
        self.counters["lookups"] += 1
        return _Restore(seq, first, lookup)

    def _release_orphans(self) -> None:
        """Leases of lookups nobody will use: released once their reply is in."""
        still = []
        for lookup in self._orphans:
            if not lookup.poll():
                still.append(lookup)
            elif lookup.ok and lookup.result is not None and lookup.result.lease_id:
                self.connector.release(lookup.result.lease_id)
        self._orphans = still

    def poll(self) -> tuple[list[Sequence], list[Sequence]]:
        """Advance restores: (sequences whose load landed: now running, sequences to requeue).

        Sequences aborted meanwhile are dropped here once nothing of theirs is in flight.
        """
        ready: list[Sequence] = []
        requeue: list[Sequence] = []
        self._lookup_wait_until = time.monotonic() + _LOOKUP_WAIT_PER_STEP_S
        if self._orphans:
            self._release_orphans()
        for request_id, r in list(self._restores.items()):
            if r.load is None:
                if not r.lookup.poll():
                    continue
                if r.seq.abort_requested:
                    del self._restores[request_id]
                    if r.lookup.ok and r.lookup.result is not None and r.lookup.result.lease_id:
                        self.connector.release(r.lookup.result.lease_id)
                    continue
                if self._reserve_and_load(r) if r.num_hit else self._begin_load(r):
                    continue
                del self._restores[request_id]
                requeue.append(r.seq)
            elif r.load.poll():
                del self._restores[request_id]
                self._finish_load(r)
                if r.seq.abort_requested:
                    self.bm.free(r.seq)
                elif r.seq.status is SequenceStatus.RUNNING:
                    ready.append(r.seq)
                else:
                    requeue.append(r.seq)
        return ready, requeue

    def _begin_load(self, r: _Restore) -> bool:
        reply = r.lookup.result if r.lookup.ok else None
        seq = r.seq
        seq.status = SequenceStatus.WAITING
        seq.offload_checked = True
        if reply is None or reply.num_hit == 0:
            self.counters["lookup_misses"] += 1
            return False
        r.lease_id, r.tiers = reply.lease_id, list(reply.tiers)
        num_hit = reply.num_hit
        tokens = num_hit * self.block_size
        if not self.always_restore and not self.restore_policy.restore_wins(
                self._expected_load_s(r.tiers), tokens, r.busy):
            self.counters["restores_declined"] += 1  # recomputing is expected to be faster
            self._release(r)
            return False
        r.num_hit = num_hit
        return self._reserve_and_load(r)

    def _reserve_and_load(self, r: _Restore) -> bool:
        """Reserve blocks for the hit and start the load; without free blocks keep the lease
        and stay LOADING (retried next step) until ``_MAX_BLOCK_WAIT_S``. False: give up."""
        seq, num_hit = r.seq, r.num_hit
        # The HBM prefix may have changed since the lookup was sent: restore only onto the
        # exact prefix it was asked for.
        hbm_hits = self.bm.match_prefix(seq)
        if len(hbm_hits) != r.first_block:
            self.counters["restores_prefix_changed"] += 1
            self._release(r)
            return False
        if not self.bm.admit(seq, hbm_hits, num_hit * self.block_size):
            now = time.monotonic()
            if r.waiting_since is None:
                r.waiting_since = now
                self.counters["restores_waited_for_blocks"] += 1
            if now - r.waiting_since < _MAX_BLOCK_WAIT_S:
                seq.status = SequenceStatus.LOADING
                return True
            self.counters["restores_no_blocks"] += 1
            self._release(r)
            seq.block_ids, seq.num_computed_tokens = [], 0
            return False
        r.num_blocks = num_hit
        dst = seq.block_ids[r.first_block:r.first_block + num_hit]
        r.load = self.connector.load(r.lease_id, dst)
        seq.status = SequenceStatus.LOADING
        self.counters["loads"] += 1
        return True

    def _expected_load_s(self, tiers: list[str]) -> float:
        by_tier = Counter(tiers)
        return sum(self.restore_policy.expected_load_s(t, n * self.block_bytes)
                   for t, n in by_tier.items())

    def _finish_load(self, r: _Restore) -> None:
        seq = r.seq
        assert r.load is not None
        dst = seq.block_ids[r.first_block:r.first_block + r.num_blocks]
        if r.load.timed_out:
            # No reply: the daemon may still write into these blocks. Keep them out of use for
            # good (counted) and start the sequence over on fresh blocks.
            self.bm.pin(dst)
            self.counters["blocks_quarantined"] += len(dst)
            self.bm.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            return
        num_loaded = int(r.load.result) if r.load.ok else 0
        num_loaded = max(0, min(num_loaded, r.num_blocks))
        if num_loaded < r.num_blocks:
            self.counters["loads_short"] += 1
        if num_loaded and r.load.ok:
            dominant = Counter(r.tiers[:num_loaded]).most_common(1)[0][0]
            self.restore_policy.observe_load(dominant, num_loaded * self.block_bytes,
                                             r.load.elapsed_s)
        bs = self.block_size
        seq.num_computed_tokens = (r.first_block + num_loaded) * bs
        restored = Counter(r.tiers[:num_loaded])
        seq.restored_tokens_by_tier = {tier: n * bs for tier, n in restored.items()}
        for tier, tokens in seq.restored_tokens_by_tier.items():
            self.hit_tokens_by_tier[tier] += tokens
        self.counters["blocks_loaded"] += num_loaded
        # Loaded blocks are known to the store: never save them back.
        self._remember_saved(seq.block_hashes[r.first_block:r.first_block + num_loaded])
        seq.num_saved_blocks = r.first_block + num_loaded
        if seq.abort_requested:
            return
        self.bm.register_computed_blocks(seq)
        seq.status = SequenceStatus.RUNNING

    def _release(self, r: _Restore) -> None:
        if r.lease_id is not None:
            self.connector.release(r.lease_id)

    # -- save and evictions -----------------------------------------------------------------

    def save_computed(self, seqs: list[Sequence]) -> None:
        """Write-through: save the full blocks this step completed (before any is freed)."""
        if self.policy == "write-through":
            for seq in seqs:
                self._save_new_blocks(seq)

    def after_step(self) -> None:
        """Send the saves the step queued, finish saves that landed, hand over released blocks
        (``evict``), publish evictions. The engine runs this after the step's outputs went out
        (at the latest before the next step is scheduled), so none of it delays a token."""
        if self._queued_saves:
            self._send_queued_saves()
        self._poll_saves()
        if self.policy == "evict":
            self._hand_over_for_eviction()
        evicted = self.bm.drain_evicted_keys()
        for namespace, keys in evicted.items():
            self.connector.evicted(namespace, keys)
            self.counters["evictions_published"] += len(keys)
        if self.generations is not None:  # after the evictions: the daemon keeps the order
            self._publish_resident()

    def _publish_resident(self) -> None:
        """Tell the store which cached blocks this arena holds now (new ones, or all of them
        after a reconnect), each with its generation."""
        items = self.bm.drain_resident()
        if self._published_epoch != self.connector.registration_epoch:
            if not self.connector.available:
                return  # republished in full once connected again
            items = self.bm.cached_items()
            self._published_epoch = self.connector.registration_epoch
        if not items:
            return
        by_namespace: dict[bytes, list[tuple[int, bytes, bytes, int]]] = {}
        gen = self.generations.get
        for block_id, cached in items:
            ident = ident_from_bytes(cached.parent_check, cached.token_bytes)
            by_namespace.setdefault(cached.namespace, []).append(
                (block_id, cached.key, ident, gen(block_id)))
        for namespace, rows in by_namespace.items():
            for i in range(0, len(rows), _RESIDENT_BATCH):
                ids, keys, idents, gens = zip(*rows[i:i + _RESIDENT_BATCH])
                self.connector.resident(namespace, ids, keys, idents, gens)
        self.counters["resident_published"] += len(items)

    def observe_step(self, num_prefill_tokens: int, seconds: float) -> None:
        """Feed the step model the restore decision compares against."""
        self.restore_policy.observe_step(num_prefill_tokens, seconds)

    def wait_for_progress(self, timeout_s: float) -> None:
        """Nothing to run but restores in flight: wait up to ``timeout_s`` for a store reply."""
        for r in self._restores.values():
            transfer = r.load or r.lookup
            if not transfer.done:
                transfer.wait(timeout_s)
                return

    def _save_new_blocks(self, seq: Sequence) -> None:
        num_full = min(seq.num_computed_tokens // self.block_size, seq.num_registered_blocks)
        start = seq.num_saved_blocks
        if num_full <= start:
            return
        js = [j for j in range(start, num_full) if seq.block_hashes[j] not in self._saved_keys]
        seq.num_saved_blocks = num_full
        if not js or not self.connector.available:
            return
        # Pinned now (before a finished sequence frees them); the idents and the request are
        # built in ``after_step``, once the step's outputs are on their way.
        # (The ids are taken now: a sequence that finishes this step gives its blocks back.)
        block_ids = [seq.block_ids[j] for j in js]
        self.bm.pin(block_ids)
        self._queued_saves.append((seq, js, block_ids))

    def _send_queued_saves(self) -> None:
        queued, self._queued_saves = self._queued_saves, []
        for seq, js, block_ids in queued:
            for i in range(0, len(js), _SAVE_BATCH):
                chunk, ids = js[i:i + _SAVE_BATCH], block_ids[i:i + _SAVE_BATCH]
                if not self.connector.available:  # gone since: nothing will land, let them go
                    self.bm.unpin(ids)
                    continue
                self._send_save(seq.namespace_digest, ids, [seq.block_hashes[j] for j in chunk],
                                self._idents(seq, chunk))

    def _hand_over_for_eviction(self) -> None:
        # A cached block whose last user let go is saved now and pinned until the store has
        # it, so the engine never reuses (evicts) a block the store does not hold yet.
        by_namespace: dict[bytes, list[tuple[int, bytes, bytes]]] = {}
        for block_id, cached in self.bm.drain_released():
            if cached.key in self._saved_keys:
                continue
            ident = ident_from_bytes(cached.parent_check, cached.token_bytes)
            by_namespace.setdefault(cached.namespace, []).append((block_id, cached.key, ident))
        for namespace, items in by_namespace.items():
            for i in range(0, len(items), _SAVE_BATCH):
                chunk = items[i:i + _SAVE_BATCH]
                self._start_save(namespace, [c[0] for c in chunk], [c[1] for c in chunk],
                                 [c[2] for c in chunk])

    def _start_save(self, namespace: bytes, block_ids: list[int], keys: list[bytes],
                    idents: list[bytes]) -> None:
        if not block_ids or not self.connector.available:
            return
        self.bm.pin(block_ids)  # not reused before the store has the bytes
        self._send_save(namespace, block_ids, keys, idents)

    def _send_save(self, namespace: bytes, block_ids: list[int], keys: list[bytes],
                   idents: list[bytes]) -> None:
        """The save request for blocks already pinned (unpinned when it ends)."""
        transfer = self.connector.save(namespace, block_ids, keys, idents)
        self._saves.append(_Save(transfer, block_ids, keys))
        self.counters["saves"] += 1

    def _poll_saves(self) -> None:
        still: list[_Save] = []
        for s in self._saves:
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
            self._remember_saved(stored)
            self.bm.unpin(s.block_ids)
        self._saves = still

    def _remember_saved(self, keys: list[bytes]) -> None:
        # Insertion order is age: the oldest keys go first once over the bound.
        saved = self._saved_keys
        saved.update(dict.fromkeys(keys))
        excess = len(saved) - 4 * self.bm.num_blocks
        if excess > 0:
            for key in list(itertools.islice(saved, excess)):
                del saved[key]

    # -- helpers ----------------------------------------------------------------------------

    def _idents(self, seq: Sequence, blocks: range | list[int]) -> list[bytes]:
        """Store idents of the sequence's full blocks ``blocks`` (ascending), from the bytes
        its hashes were made of. The full-strength chain hash is the parent: it verifies the
        whole prefix, even with truncated keys."""
        if not blocks:
            return []
        step = 4 * self.block_size
        tokens = seq.encoded_tokens((blocks[-1] + 1) * self.block_size)
        checks, namespace = seq.block_checks, seq.namespace_digest
        return [ident_from_bytes(checks[j - 1] if j else namespace,
                                 tokens[j * step:(j + 1) * step]) for j in blocks]

    def abort(self, seq: Sequence) -> bool:
        """Mark a loading sequence aborted; True if it is still in flight (finish it later)."""
        if seq.request_id in self._restores:
            seq.abort_requested = True
            return True
        return False

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Block until in-flight saves finish or ``timeout_s`` passes (shutdown, tests)."""
        if self._queued_saves:
            self._send_queued_saves()
        deadline = time.monotonic() + timeout_s
        while self._saves and time.monotonic() < deadline:
            self._saves[0].transfer.wait(max(0.0, deadline - time.monotonic()))
            self._poll_saves()

    def close(self) -> None:
        """Let in-flight saves finish (bounded), then unregister from the store."""
        self.wait_idle()
        self.connector.close()  # the daemon forgets this arena's resident blocks
        if self.generations is not None:
            self.generations.close()

    def stats(self) -> dict:
        out = dict(self.counters)
        out["connector"] = dict(self.connector.counters)
        out["restored_tokens_by_tier"] = dict(self.hit_tokens_by_tier)  # peer HBM included
        out["restore_policy"] = self.restore_policy.snapshot()
        out["num_loading"] = self.num_loading
        out["saves_in_flight"] = len(self._saves)
        return out


# Until measured: bytes/s per tier and prefill tokens/s, per device kind. Deliberately modest for
# the store so the first restores happen only where they clearly pay.
_PRIORS = {
    "cpu": ({"hbm": 4e9, "dram": 2e9, "ssd": 5e8, "remote": 2e8}, 2e3),
    "cuda": ({"hbm": 2e11, "dram": 2e10, "ssd": 1e9, "remote": 1e9}, 2e4),
}


def make_offload_manager(socket_path: str | None, layout: KVLayout, engine_id: str,
                         block_manager: BlockManager, block_bytes: int, policy: str,
                         device: str, always_restore: bool = False,
                         share_hbm: bool = True) -> OffloadManager:
    """Connect to the store (or keep retrying in the background) and build the manager.

    ``share_hbm``: publish the cached blocks as the store's HBM tier (block generations in
    shared memory, named in the registered layout)."""
    bandwidth, prefill = _PRIORS["cuda" if device.startswith("cuda") else "cpu"]
    generations = None
    if share_hbm:
        try:
            generations = BlockGenerations(layout.num_blocks)
        except OSError as exc:  # no /dev/shm room: serve, just without sharing the arena
            log.warning("kv offload: cannot create block generations in shared memory (%s); "
                        "this engine's blocks are not offered to other engines", exc)
    if generations is not None:
        layout = dataclasses.replace(layout, generations=generations.name)
    try:
        connector = OffloadConnector(socket_path, layout, engine_id)
    except BaseException:
        if generations is not None:
            generations.close()
        raise
    block_manager.track_offload = True
    return OffloadManager(connector, block_manager, block_bytes, policy,
                          RestorePolicy(dict(bandwidth), prefill), always_restore, generations)

