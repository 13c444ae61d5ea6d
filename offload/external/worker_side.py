"""The worker half of a hosted connector: the engine's step plan turned into the core's
restores and saves.

The daemon is reached through ``StoreClient`` (a thread owns the connection; registration,
reconnects and the health probes that find a hung daemon happen there, never in an engine
step). Loads are restores of the shared core (``offload.core.Restorer``) into the block mover
(this engine's ``BlockSite``), advanced by ``poll``, which the engine calls every step (vLLM:
even steps without a forward). The engine's scheduler decided each load when it planned it, so
every hit is loaded (``Always``). Whatever does not arrive (a shorter hit, a short load, an
error, a deadline, a hung or lost daemon) is reported as failed block ids of the engine, which
recomputes them; the request is reported finished either way. Saves go through the core's
``Saver`` and never hold up a step: staged ones are copied out into free slots (a save that
finds the saves' share of the slots taken waits for room, in order) and sent once copied;
direct ones (the daemon reads the engine's blocks) are sent once the step's compute wrote the
blocks (``ready``, an event). A request with saves keeps its blocks (the scheduler side said so when
it finished) until ``finished_saving`` reports it, once its saves ended; a preempted one's
saves are flushed (waited for, bounded) before the next forward may reuse its blocks. Under
tensor parallelism every rank has its own worker side, registration and shard namespace
(``shard_namespace`` of the plan's): a rank loads only its own shard, and what it misses is
reported failed like any short load.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from pathlib import Path

from kvstore.keys import shard_namespace
from offload.core.decider import Always
from offload.core.restore_job import RestoreJob
from offload.core.restorer import Restorer, RestoreSettings
from offload.core.save_job import SaveJob
from offload.core.saver import Saver
from offload.external.block_mover import BlockMover
from offload.external.plan import BlockTransfer, StepPlan
from offload.store_client import StoreClient

MAX_STORED_REPORTS = 1 << 16


class WorkerSide:
    """Owns the store client of the engine's KV memory, its restorer and saver, and the
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
        self.client = StoreClient(socket_path, mover.open, engine_id, load_timeout_s,
                                  retry_interval_s, connect_wait_s=0.0,
                                  register_timeout_s=register_timeout_s,
                                  on_registered=mover.registered)
        # A load's whole life (lookup, room, copy) is bounded by load_timeout_s; its lease
        # lives at least the default TTL (the load follows within a step or two).
        settings = RestoreSettings(lease_ttl_s=max(RestoreSettings().lease_ttl_s,
                                                   2 * load_timeout_s),
                                   max_lookup_wait_s=load_timeout_s,
                                   max_slot_wait_s=load_timeout_s,
                                   load_deadline_s=load_timeout_s)
        self.restorer: Restorer[BlockTransfer] = Restorer(self.client, mover, Always(),
                                                          self.counters, settings)
        self.saver = Saver(self.client, mover, self.counters, save_timeout_s)
        self._finished: set[str] = set()
        self._failed_block_ids: set[int] = set()
        self._save_jobs: dict[str, list[SaveJob]] = {}  # by request: pinned or in flight
        self._saving: set[str] = set()  # requests with saves planned (the scheduler's rule)
        self._finishing: set[str] = set()  # finished requests whose saves are still going
        # Hashes the daemon holds by ended saves, until taken (bounded: a caller that never
        # takes them, a benchmark, keeps only the latest).
        self._stored: deque[bytes] = deque(maxlen=MAX_STORED_REPORTS)

    def ready(self) -> bool:
        """Registered and answering (not connected: a reconnect is asked for, off this
        thread)."""
        return self.client.available

    def connect(self, wait_s: float = 5.0) -> bool:
        """Wait (at startup, at most ``wait_s``) until registered; a registration still in
        flight then finishes on the link's thread."""
        return self.client.wait_available(wait_s)

    def _namespace(self, namespace: bytes) -> bytes:
        """This rank's namespace for a plan's (the plan's own with one rank)."""
        return shard_namespace(namespace, self.shard, self.num_shards)

    # ---------------------------------------------------------------------------------- loads

    def start(self, plan: StepPlan) -> None:
        """Send the plan's loads (non-blocking): each a lookup the daemon loads at once into
        slots the mover lends now (one round trip), or, where the mover has no room yet or
        the daemon predates ``lookup_load``, a lookup whose hit is loaded once slots are
        lent."""
        ahead = self.client.daemon_knows("lookup_load")
        for t in plan.loads:
            namespace = self._namespace(t.namespace)
            if ahead and self.restorer.look_up_and_load(
                    t, namespace, t.hashes, t.idents, 0, busy=True, min_blocks=1) is not None:
                self.counters["loads_ahead"] += 1
                continue  # tracked: ``poll`` advances it
            job = self.restorer.look_up(t, namespace, t.hashes, t.idents)
            if self.restorer.start(job):  # ended at once (the store is hung)
                self._report(job)

    def poll(self) -> tuple[set[str], set[int]]:
        """Advance loads and saves; (request ids whose load finished, the engine's block ids
        that failed to load) since the last call."""
        # Every step (vLLM calls this even in steps without a forward) asks for a reconnect
        # after an outage, so the store is back before the next save needs it.
        self.client.keep_connected()
        for job in self.restorer.poll():
            self._report(job)
        self.pump_saves()
        finished, self._finished = self._finished, set()
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return finished, failed

    def _report(self, job: RestoreJob[BlockTransfer]) -> None:
        """A restore ended: the blocks past what landed failed (the engine recomputes
        them)."""
        t = job.owner
        if job.num_loaded < t.num_blocks:
            self._failed_block_ids.update(t.block_ids[job.num_loaded:])
            self.counters["blocks_load_failed"] += t.num_blocks - job.num_loaded
        self._finished.add(t.request_id)

    # ---------------------------------------------------------------------------------- saves

    def save(self, plan: StepPlan, ready: Callable[[], bool] | None = None) -> None:
        """Write-through: pin every planned save (the forward computed the blocks, or will
        have once ``ready``), in requests of at most the mover's ``max_save_blocks``, and send
        those that are ready. Never waits."""
        most = self.mover.max_save_blocks
        for save in plan.saves:
            self._saving.add(save.request_id)
            for t in save.chunks(most):
                job = self.saver.pin(self._namespace(t.namespace), t.block_ids, t.hashes,
                                     t.idents, ready)
                if job is not None:
                    self._save_jobs.setdefault(t.request_id, []).append(job)
        self.saver.send_pinned()
        self.pump_saves()

    def flush(self, request_ids: Iterable[str]) -> None:
        """Wait (bounded by the save deadline) until these requests' saves ended: the engine
        is about to hand their blocks to others. Saves still waiting for staging room are
        dropped instead (counted): they would copy the blocks out only after that."""
        jobs = [job for rid in request_ids for job in self._save_jobs.get(rid, ())]
        self.saver.drop_waiting(jobs)
        jobs = [job for job in jobs if not job.over]
        if jobs:
            self.counters["save_flushes"] += 1
            self.saver.wait(jobs, self.save_timeout_s)  # a miss drops the connection
            self.pump_saves()

    def finished_saving(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Of the requests that finished (now or before), those whose saves all ended: the
        engine may free their blocks (vLLM's ``finished_sending``)."""
        self._finishing.update(rid for rid in finished_req_ids if rid in self._saving)
        self.pump_saves()
        done = {rid for rid in self._finishing if rid not in self._save_jobs}
        self._finishing -= done
        self._saving -= done
        return done

    def pump_saves(self) -> None:
        """Send the saves that became ready (the last step's, once its compute is done),
        account the ended ones, forget them. The engine's worker calls this before each forward
        too, so the daemon copies the last step's blocks beside it."""
        self.saver.send_pinned()
        self.saver.poll()
        for rid in [rid for rid, jobs in self._save_jobs.items() if all(j.over for j in jobs)]:
            for job in self._save_jobs.pop(rid):
                self._stored.extend(job.stored_hashes)

    def take_stored(self) -> list[bytes]:
        """The store hashes of blocks the daemon holds after saves that ended since the last
        call (saved, or there already): the scheduler side announces them (KV events)."""
        self.pump_saves()
        stored = list(self._stored)
        self._stored.clear()
        return stored

    @property
    def num_in_flight(self) -> int:
        return len(self.restorer.jobs) + len(self.saver.pinned) + len(self.saver.in_flight)

    def drain(self, timeout_s: float) -> None:
        """Wait (bounded) for everything in flight: tests, benchmarks and shutdown. Waits on
        the replies themselves (woken as each lands), never in sleeps."""
        deadline = time.monotonic() + timeout_s
        self.saver.wait(self.saver.pinned + self.saver.in_flight, timeout_s)
        self.pump_saves()
        while self.restorer.jobs and time.monotonic() < deadline:
            self.restorer.wait_for_progress(min(0.05, max(0.0, deadline - time.monotonic())))
            self.poll()

    def close(self) -> None:
        self.client.close()
        self.mover.close()
