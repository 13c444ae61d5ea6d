"""The worker half of the connector: run the plan's loads and saves against the daemon.

A load is a small state machine advanced by ``poll`` (vLLM calls it every step, even steps
without a forward): lookup with a lease -> room in the mover -> daemon load -> land in vLLM's
blocks. Whatever does not arrive (a shorter hit, a short load, an error, a deadline) is reported
as failed vLLM block ids, and vLLM recomputes them; the request is reported finished either way.
Saves are write-through: staged ones are copied out at once and sent without waiting; direct
ones (the daemon reads vLLM's blocks) are waited for, bounded, before vLLM may reuse the blocks.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from kvstore import Client
from offload.vllm.block_mover import BlockMover, Slots
from offload.vllm.plan import BlockTransfer, StepPlan
from offload.vllm.store_link import Call, StoreLink

# A lease lives this long without its load (the load follows within a step or two).
LEASE_TTL_S = 30.0


@dataclass
class _Load:
    transfer: BlockTransfer
    lookup: Call
    started_at: float
    generation: int
    registration_id: int | None
    num_hit: int = 0
    lease_id: int | None = None
    slots: Slots | None = None
    load: Call | None = None


@dataclass
class _Save:
    call: Call
    slots: Slots
    num_blocks: int


class WorkerSide:
    """Owns the registration, the loads and saves in flight, and the worker's counters."""

    def __init__(self, link: StoreLink, mover: BlockMover, engine_id: str,
                 load_timeout_s: float, save_timeout_s: float,
                 register_timeout_s: float = 2.0) -> None:
        self.link = link
        self.mover = mover
        self.engine_id = engine_id
        self.load_timeout_s = load_timeout_s
        self.save_timeout_s = save_timeout_s
        self.register_timeout_s = register_timeout_s
        self.counters: Counter[str] = Counter()
        self.registration_id: int | None = None
        self._loads: list[_Load] = []
        self._saves: list[_Save] = []
        self._finished: set[str] = set()
        self._failed_block_ids: set[int] = set()
        link.on_connect = self._register

    def _register(self, client: Client) -> None:
        """Run on every (re)connect: a fresh layout (fresh staging) registered with a bound."""
        layout = self.mover.open()
        try:
            pending = client.request("register", {"layout": layout.to_wire(),
                                                  "engine_id": self.engine_id},
                                     timeout_s=self.register_timeout_s)
            self.registration_id = int(pending.wait(self.register_timeout_s)["registration_id"])
        finally:
            self.mover.registered()
        self.counters["registrations"] += 1

    def connect(self) -> bool:
        """Connect and register now (at startup); False if the store is not there (yet)."""
        return self.link.ensure() is not None

    # ---------------------------------------------------------------------------------- loads

    def start(self, plan: StepPlan) -> None:
        """Send the lookups of the plan's loads (non-blocking)."""
        for t in plan.loads:
            self.counters["loads"] += 1

            def send(c: Client, t: BlockTransfer = t):
                return c.lookup_async(t.namespace, t.hashes, t.idents, LEASE_TTL_S)

            call = self.link.send(send, None, self.load_timeout_s)
            self._loads.append(_Load(t, call, time.monotonic(), self.link.generation,
                                     self.registration_id))

    def poll(self) -> tuple[set[str], set[int]]:
        """Advance loads and saves; (request ids whose load finished, vLLM block ids that
        failed to load) since the last call."""
        still = []
        for job in self._loads:
            if not self._advance(job):
                still.append(job)
        self._loads = still
        self._poll_saves()
        finished, self._finished = self._finished, set()
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return finished, failed

    def _advance(self, job: _Load) -> bool:
        """One step of a load; True once it is over (finished, with any failed blocks noted)."""
        t = job.transfer
        if job.load is None:
            if job.slots is None:
                if not job.lookup.poll():
                    return False
                reply = job.lookup.result
                if reply is None or reply.num_hit == 0:
                    return self._end(job, 0, "load_misses" if reply is not None else
                                     "load_lookup_failures")
                job.num_hit = min(int(reply.num_hit), t.num_blocks)
                job.lease_id = reply.lease_id
            job.slots = self.mover.slots_for_load(t.block_ids[:job.num_hit])
            if job.slots is None:
                if time.monotonic() - job.started_at < self.load_timeout_s:
                    return False  # no staging room yet; retried next step
                self._release(job)
                return self._end(job, 0, "load_no_room")
            if job.generation != self.link.generation or job.registration_id is None:
                self._release(job)
                return self._end(job, 0, "load_reconnected")
            reg, lease, ids = job.registration_id, job.lease_id, job.slots.block_ids

            def send(c: Client):
                return c.load_async(reg, lease, ids, self.load_timeout_s)

            job.load = self.link.send(send, 0, self.load_timeout_s)
            return False
        if not job.load.poll():
            return False
        num_loaded = max(0, min(int(job.load.result), job.num_hit)) if job.load.ok else 0
        if job.load.ok:
            self.mover.land(job.slots, t.block_ids, num_loaded)
            self.mover.give_back(job.slots)  # a failed call's buffer is abandoned instead
        return self._end(job, num_loaded, "load_errors" if not job.load.ok else "")

    def _release(self, job: _Load) -> None:
        if job.lease_id is not None and job.generation == self.link.generation:
            lease_id = job.lease_id
            self.link.send(lambda c: c.request("release", {"lease_id": lease_id}), None)
        if job.slots is not None:
            self.mover.give_back(job.slots)

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
        """Write-through: send every planned save (after the forward computed the blocks)."""
        for t in plan.saves:
            if not self.link.connected and self.link.ensure() is None:
                self.counters["blocks_save_skipped_unavailable"] += t.num_blocks
                continue
            slots = self.mover.slots_for_save(t.block_ids)
            if slots is None:
                self.counters["blocks_save_skipped_no_room"] += t.num_blocks
                continue
            reg, ids = self.registration_id, slots.block_ids

            def send(c: Client, t: BlockTransfer = t, reg: int | None = reg,
                     ids: list[int] = ids):
                return c.save_async(reg, t.namespace, ids, t.hashes, t.idents,
                                    self.save_timeout_s)

            call = self.link.send(send, None, self.save_timeout_s)
            self._saves.append(_Save(call, slots, t.num_blocks))
        if self.mover.saves_read_engine_blocks:
            for s in self._saves:
                s.call.wait()  # bounded by its deadline; a miss trips the link
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
                self.mover.give_back(s.slots)
            else:
                self.counters["blocks_save_failed"] += s.num_blocks
                if s.call.error not in ("deadline", "unavailable"):
                    self.mover.give_back(s.slots)  # an error reply: the daemon let go
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
        self.link.close()
        self.mover.close()
