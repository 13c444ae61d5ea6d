"""The worker half of the connector: run the plan's loads and saves against the daemon.

The daemon is reached through ``OffloadConnector``, kvengine's own link (a thread owns the
connection; registration, reconnects and the health probes that find a hung daemon happen
there, never in a vLLM step). A load is a small state machine advanced by ``poll`` (vLLM calls
it every step, even steps without a forward): lookup with a lease -> room in the mover -> daemon
load -> land in vLLM's blocks. Whatever does not arrive (a shorter hit, a short load, an error, a
deadline, a hung or lost daemon) is reported as failed vLLM block ids, and vLLM recomputes them;
the request is reported finished either way. Saves are write-through: staged ones are copied out
at once and sent without waiting; direct ones (the daemon reads vLLM's blocks) are waited for,
bounded, before vLLM may reuse the blocks. Every request naming daemon-side block ids carries
the connection epoch they were taken on, so it never goes out on another registration. Under
tensor parallelism every rank has its own worker side, registration and shard namespace
(``shard_namespace`` of the plan's): a rank loads only its own shard, and what it misses is
reported failed like any short load.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvstore.keys import shard_namespace
from offload.connector import OffloadConnector
from offload.transfer import Transfer
from offload.vllm.block_mover import BlockMover, Slots
from offload.vllm.plan import BlockTransfer, StepPlan

# A lease lives this long without its load (the load follows within a step or two).
LEASE_TTL_S = 30.0


@dataclass
class _Load:
    transfer: BlockTransfer
    lookup: Transfer  # its ``sent_epoch`` is the connection its lease belongs to
    started_at: float
    num_hit: int = 0
    lease_id: int | None = None
    slots: Slots | None = None
    load: Transfer | None = None


@dataclass
class _Save:
    call: Transfer
    slots: Slots
    num_blocks: int


class WorkerSide:
    """Owns the store link of vLLM's KV memory, the loads and saves in flight, and the
    worker's counters."""

    def __init__(self, socket_path: str | Path | None, mover: BlockMover, engine_id: str,
                 load_timeout_s: float, save_timeout_s: float,
                 register_timeout_s: float = 30.0, retry_interval_s: float = 2.0,
                 shard: int = 0, num_shards: int = 1) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"rank {shard} of {num_shards}: need 0 <= rank < num_shards")
        self.shard, self.num_shards = shard, num_shards
        self.mover = mover
        self.engine_id = engine_id
        self.load_timeout_s = load_timeout_s
        self.save_timeout_s = save_timeout_s
        self.counters: Counter[str] = Counter()
        # The mover makes the layout on every (re)connect (a fresh staging buffer on CPU) and
        # lets go of its name once the daemon has answered the registration.
        self.store = OffloadConnector(socket_path, mover.open, engine_id, load_timeout_s,
                                      retry_interval_s, connect_wait_s=0.0,
                                      register_timeout_s=register_timeout_s,
                                      on_registered=mover.registered)
        self._loads: list[_Load] = []
        self._given_up: list[_Load] = []  # loads given up while in flight: slots still lent
        self._saves: list[_Save] = []
        self._finished: set[str] = set()
        self._failed_block_ids: set[int] = set()

    def ready(self) -> bool:
        """Registered and answering (not connected: a reconnect is asked for, off this
        thread)."""
        return self.store.available

    def connect(self, wait_s: float = 5.0) -> bool:
        """Wait (at startup, at most ``wait_s``) until registered; a registration still in
        flight then finishes on the link's thread."""
        return self.store.wait_available(wait_s)

    def _namespace(self, namespace: bytes) -> bytes:
        """This rank's namespace for a plan's (the plan's own with one rank)."""
        return shard_namespace(namespace, self.shard, self.num_shards)

    # ---------------------------------------------------------------------------------- loads

    def start(self, plan: StepPlan) -> None:
        """Send the lookups of the plan's loads (non-blocking)."""
        for t in plan.loads:
            self.counters["loads"] += 1
            lookup = self.store.lookup(self._namespace(t.namespace), t.hashes, t.idents,
                                       LEASE_TTL_S)
            self._loads.append(_Load(t, lookup, time.monotonic()))

    def poll(self) -> tuple[set[str], set[int]]:
        """Advance loads and saves; (request ids whose load finished, vLLM block ids that
        failed to load) since the last call."""
        # Every step (vLLM calls this even in steps without a forward) asks for a reconnect
        # after an outage, so the store is back before the next save needs it.
        self.store.keep_connected()
        hung = self.store.state == "hung"
        still = []
        for job in self._loads:
            if not self._advance(job, hung):
                still.append(job)
        self._loads = still
        self._given_up = [job for job in self._given_up if not self._settled(job)]
        self.store.release_disowned()
        self._poll_saves()
        finished, self._finished = self._finished, set()
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return finished, failed

    def _advance(self, job: _Load, hung: bool) -> bool:
        """One step of a load; True once it is over (finished, with any failed blocks noted).
        A load still waiting on a daemon found hung is given up at once (kvengine's rule)."""
        t = job.transfer
        if job.load is None:
            if job.lease_id is None:
                if not job.lookup.poll():
                    if hung:
                        self.store.disown(job.lookup)
                        return self._end(job, 0, "load_store_hung")
                    return False
                reply = job.lookup.result
                if reply is None or reply.num_hit == 0 or reply.lease_id is None:
                    return self._end(job, 0, "load_misses" if reply is not None else
                                     "load_lookup_failures")
                job.num_hit = min(int(reply.num_hit), t.num_blocks)
                job.lease_id = reply.lease_id
            if job.lookup.sent_epoch != self.store.registration_epoch:
                return self._end(job, 0, "load_reconnected")  # the lease was that connection's
            if not self.ready():
                if time.monotonic() - job.started_at < self.load_timeout_s:
                    return False  # a registration or a probe is on its way
                self._release(job)
                return self._end(job, 0, "load_not_registered")
            job.slots = self.mover.slots_for_load(t.block_ids[:job.num_hit])
            if job.slots is None:
                if time.monotonic() - job.started_at < self.load_timeout_s:
                    return False  # no staging room yet; retried next step
                self._release(job)
                return self._end(job, 0, "load_no_room")
            job.load = self.store.load(job.lease_id, job.slots.block_ids, self.load_timeout_s,
                                       epoch=job.lookup.sent_epoch)
            return False
        if not job.load.poll():
            if hung:  # vLLM recomputes now; the slots stay lent until the daemon lets go
                self._given_up.append(job)
                return self._end(job, 0, "load_store_hung")
            return False
        num_loaded = max(0, min(int(job.load.result), job.num_hit)) if job.load.ok else 0
        if job.load.ok:
            self.mover.land(job.slots, t.block_ids, num_loaded)
        self._settled(job)
        return self._end(job, num_loaded, "load_errors" if not job.load.ok else "")

    def _settled(self, job: _Load) -> bool:
        """Once the load is over, its slots go back unless the daemon may still write into
        them (no reply by the deadline: that buffer is abandoned on the reconnect that
        follows). True once over."""
        if not job.load.poll():
            return False
        if job.load.answered or job.load.never_sent:
            self.mover.give_back(job.slots)
        return True

    def _release(self, job: _Load) -> None:
        if job.lease_id is not None and job.lookup.sent_epoch == self.store.registration_epoch:
            self.store.release(job.lease_id)

    def _end(self, job: _Load, num_loaded: int, reason: str) -> bool:
        t = job.transfer
        if reason:
            self.counters[reason] += 1
        if num_loaded < t.num_blocks:
            self._failed_block_ids.update(t.block_ids[num_loaded:])
            self.counters["blocks_load_failed"] += t.num_blocks - num_loaded
        self.counters["blocks_loaded"] += num_loaded
        self._finished.add(t.request_id)
        return True

    # ---------------------------------------------------------------------------------- saves

    def save(self, plan: StepPlan) -> None:
        """Write-through: send every planned save (after the forward computed the blocks), in
        requests of at most the mover's ``max_save_blocks``."""
        most = self.mover.max_save_blocks
        for t in (piece for save in plan.saves for piece in save.chunks(most)):
            epoch = self.store.registration_epoch  # before the slots: see the module docstring
            if not self.ready():
                self.counters["blocks_save_skipped_unavailable"] += t.num_blocks
                continue
            slots = self.mover.slots_for_save(t.block_ids)
            if slots is None:
                self.counters["blocks_save_skipped_no_room"] += t.num_blocks
                continue
            call = self.store.save(self._namespace(t.namespace), slots.block_ids, t.hashes,
                                   t.idents, self.save_timeout_s, epoch=epoch)
            self._saves.append(_Save(call, slots, t.num_blocks))
        if self.mover.saves_read_engine_blocks:
            for s in self._saves:
                s.call.wait()  # bounded by its deadline; a miss drops the connection
        self._poll_saves()

    def _poll_saves(self) -> None:
        still = []
        for s in self._saves:
            if not s.call.poll():
                still.append(s)
                continue
            if s.call.ok:
                outcomes = s.call.result.outcomes
                self.counters["blocks_saved"] += outcomes.count("saved")
                self.counters["blocks_save_duplicate"] += outcomes.count("duplicate")
                self.counters["blocks_save_failed"] += outcomes.count("failed")
            else:
                self.counters["blocks_save_failed"] += s.num_blocks
            if s.call.answered or s.call.never_sent:
                self.mover.give_back(s.slots)  # else the daemon may still read them: abandoned
        self._saves = still

    @property
    def num_in_flight(self) -> int:
        return len(self._loads) + len(self._saves)

    def drain(self, timeout_s: float) -> None:
        """Wait (bounded) for everything in flight: tests and shutdown."""
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.002)

    def close(self) -> None:
        self.store.close()
        self.mover.close()
