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

from kvstore import Client, ClientError, DaemonUnavailable, Pending
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
                 register_timeout_s: float = 30.0) -> None:
        self.link = link
        self.mover = mover
        self.engine_id = engine_id
        self.load_timeout_s = load_timeout_s
        self.save_timeout_s = save_timeout_s
        self.register_timeout_s = register_timeout_s
        self.counters: Counter[str] = Counter()
        self.registration_id: int | None = None
        self._registered_on = -1  # the link generation the registration belongs to
        self._registering: Pending | None = None
        self._registering_until = 0.0
        self._loads: list[_Load] = []
        self._saves: list[_Save] = []
        self._finished: set[str] = set()
        self._failed_block_ids: set[int] = set()
        link.on_connect = self._register

    def _register(self, client: Client) -> None:
        """Run on every (re)connect: send the registration of a fresh layout (fresh staging)
        without waiting; ``ready`` polls it. A daemon's first CUDA registration can take
        seconds (it sets up its copier), and a stopped daemon never answers: neither may stall
        a vLLM step."""
        layout = self.mover.open()
        self.registration_id = None
        try:
            self._registering = client.request("register", {"layout": layout.to_wire(),
                                                            "engine_id": self.engine_id},
                                               timeout_s=self.register_timeout_s)
        except BaseException:
            self.mover.registered()
            raise
        self._registering_until = time.monotonic() + self.register_timeout_s

    def ready(self) -> bool:
        """Connected and registered on this connection (advances a registration in flight)."""
        if self.link.ensure() is None:
            return False
        pending = self._registering
        if pending is not None:
            if pending.poll():
                self._registering = None
                self.mover.registered()
                try:
                    self.registration_id = int(pending.wait(0)["registration_id"])
                    self._registered_on = self.link.generation
                    self.counters["registrations"] += 1
                except (ClientError, DaemonUnavailable) as exc:
                    self.counters["register_failures"] += 1
                    self.link.trip(getattr(exc, "code", "unavailable"), self.link.generation)
            elif time.monotonic() >= self._registering_until:
                self._registering = None
                self.mover.registered()
                self.counters["register_failures"] += 1
                self.link.trip("deadline", self.link.generation)
        return self.registration_id is not None and self._registered_on == self.link.generation

    def connect(self, wait_s: float = 5.0) -> bool:
        """Connect and register now (at startup), waiting at most ``wait_s`` for the reply; a
        registration still in flight then finishes in the background."""
        deadline = time.monotonic() + wait_s
        while not self.ready():
            if self._registering is None and self.link.ensure() is None:
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True

    # ---------------------------------------------------------------------------------- loads

    def start(self, plan: StepPlan) -> None:
        """Send the lookups of the plan's loads (non-blocking)."""
        for t in plan.loads:
            self.counters["loads"] += 1

            def send(c: Client, t: BlockTransfer = t):
                return c.lookup_async(t.namespace, t.hashes, t.idents, LEASE_TTL_S)

            call = self.link.send(send, None, self.load_timeout_s)
            self._loads.append(_Load(t, call, time.monotonic(), self.link.generation))

    def poll(self) -> tuple[set[str], set[int]]:
        """Advance loads and saves; (request ids whose load finished, vLLM block ids that
        failed to load) since the last call."""
        # Every step (vLLM calls this even in steps without a forward) advances a registration
        # in flight and, after an outage, reconnects (rate-limited by the link's breaker; the
        # registration is only sent here), so the store is back before the next save needs it.
        self.ready()
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
            if job.generation != self.link.generation:
                self._release(job)
                return self._end(job, 0, "load_reconnected")  # the lease was that connection's
            if not self.ready():
                self.mover.give_back(job.slots)
                job.slots = None
                if time.monotonic() - job.started_at < self.load_timeout_s:
                    return False  # the registration is still on its way
                self._release(job)
                return self._end(job, 0, "load_not_registered")
            reg, lease, ids = self.registration_id, job.lease_id, job.slots.block_ids

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
            if not self.ready():
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
