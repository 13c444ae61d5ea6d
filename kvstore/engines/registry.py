"""Registered engines by id: opening a layout's memory, finding it per connection, closing it.

A CPU layout opens a ``ShmRegistration`` over the file descriptors sent with its frame, a GPU one
a ``CudaRegistration`` (one ``CudaCopier`` per device, all with the daemon's ``CopySettings``; one
IPC table for the process). Any piece of engine memory, a CUDA IPC handle or host memory behind a
descriptor (``MemoryClaims``), is held by one registration at a time, until that registration
is closed and its last copy done: an engine that registers the same memory again (a reconnect)
is accepted only once no copy of its old registration reads or writes it. Owners are connection
names: a disconnect closes every registration of its connection, and only the owning connection
may use, publish or unregister a registration. What a connection keeps mapped is bounded
(``max_mappings_per_owner``): each mapping holds a descriptor of the daemon.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence

from kvstore.engines.copier import CudaCopier
from kvstore.engines.copy_settings import CopySettings
from kvstore.engines.copy_timing import CopyTiming
from kvstore.engines.cuda_fault import CudaFault
from kvstore.engines.cuda_ipc import hold_primary_context
from kvstore.engines.cuda_registration import CudaRegistration, IpcTable
from kvstore.engines.leaving_owners import LeavingOwners
from kvstore.engines.memory_claims import MemoryClaims, memory_key
from kvstore.engines.registration import (  # noqa: F401 (the registry's errors, re-exported)
    BlockIdsOutOfRange,
    Registration,
    RegistrationClosed,
    RegistryError,
)
from kvstore.engines.shm_registration import ShmRegistration, fd_of, map_fd
from kvstore.engines.warm_up import open_peer_mappings, warm_copier
from kvstore.layout import GENERATION_BYTES, KVLayout
from kvstore.listeners import Listeners

log = logging.getLogger(__name__)

MAX_MAPPINGS_PER_OWNER = 64

CloseListener = Callable[[Registration], None]


class Registry:
    """Registrations by id; thread-safe. Owners are connection names, so a disconnect drops all."""

    def __init__(self, copy_settings: CopySettings = CopySettings(),
                 max_mappings_per_owner: int = MAX_MAPPINGS_PER_OWNER,
                 debug_corrupt_engine: str | None = None,
                 max_owners: int | None = None,
                 close_listeners: Sequence[CloseListener] = ()) -> None:
        """``debug_corrupt_engine`` (tests only): that engine's CUDA regions are addressed 16 TiB
        past their mapping, behind every check, so its first copy meets a real sticky error.
        ``max_owners``: how many connections may hold registrations at once (None: any).
        ``close_listeners``: see ``add_close_listener``."""
        self.copy_settings = copy_settings
        self.debug_corrupt_engine = debug_corrupt_engine
        self.max_mappings_per_owner = max_mappings_per_owner
        self.max_owners = max_owners
        self._lock = threading.Lock()
        self._by_id: dict[int, Registration] = {}
        self._ids = itertools.count(1)
        self._ipc = IpcTable()
        self._claims = MemoryClaims()
        self._leaving = LeavingOwners()  # closed connections whose registrations still live
        self._copiers: dict[int, CudaCopier] = {}
        self.cuda_fault = CudaFault()  # the process's CUDA context, shared by every copier
        self._close_listeners: Listeners[CloseListener] = Listeners(
            "closed registrations", close_listeners)

    def register(self, layout_wire: dict, engine_id: str, owner: str,
                 fds: Sequence[int] = ()) -> Registration:
        """Map a layout's memory (CPU memory and block generations from ``fds``, the
        descriptors sent with the register frame, which stay the caller's to close);
        RegistryError(bad_request|permission_denied|unsupported|not_found|resource_exhausted)
        if impossible. Refused as held by another registration while a closed connection's
        registrations are being dropped, it waits for them (bounded) and tries once more."""
        try:
            return self._register(layout_wire, engine_id, owner, fds)
        except RegistryError as exc:
            if exc.code != "permission_denied" or not self._leaving.wait():
                raise
        return self._register(layout_wire, engine_id, owner, fds)

    def owner_leaving(self, owner: str) -> None:
        """``owner``'s connection closed: ``drop_owner`` follows (see ``LeavingOwners``)."""
        self._leaving.mark(owner)

    def _register(self, layout_wire: dict, engine_id: str, owner: str,
                  fds: Sequence[int]) -> Registration:
        try:
            layout = KVLayout.from_wire(layout_wire)
        except (ValueError, TypeError) as exc:
            raise RegistryError("bad_request", f"invalid layout: {exc}") from None
        keys = self._memory_keys(layout, fds)  # names are refused here, before any mapping
        with self._lock:
            held = sum(r.num_mappings for r in self._by_id.values() if r.owner == owner)
            # A router maps engines by engine_id: another connection may not take a live one's.
            taken = any(r.engine_id == engine_id and r.owner != owner and not r.closed
                        for r in self._by_id.values())
            # a closed connection's registrations, still being dropped, hold no connection
            owners = {r.owner for r in self._by_id.values() if r.owner not in self._leaving}
        if self.max_owners is not None and owner not in owners and \
                len(owners) >= self.max_owners:
            raise RegistryError("resource_exhausted", f"{len(owners)} connections hold "
                                "registrations, the most this daemon keeps (half its "
                                "connection cap: the rest stay free for new clients)")
        if taken:
            raise RegistryError("permission_denied", f"engine_id {engine_id!r} is registered "
                                "by another live connection")
        if held >= self.max_mappings_per_owner:
            raise RegistryError("resource_exhausted", f"this connection keeps {held} mappings "
                                "of engine memory, the most one may; unregister some first")
        reg: Registration
        if layout.device != "cpu":
            reg = CudaRegistration.open(self._ids, engine_id, layout, owner, self._copier,
                                        self._ipc,
                                        corrupt=engine_id == self.debug_corrupt_engine)
        else:
            reg = ShmRegistration.open(next(self._ids), engine_id, layout, owner, fds)
        try:
            self._claims.claim(keys, reg.registration_id)
            # Given back once the last copy is done, not at close (see ``when_unmapped``).
            reg.when_unmapped(functools.partial(self._claims.release, reg.registration_id))
            if layout.generations is not None:
                self._map_generations(reg, fd_of(layout.generations, fds, "block generations"))
        except BaseException:  # never listed: nobody else needs to hear of it
            reg.close()  # no copy ran: unmapped now, its claims with it
            self._claims.release(reg.registration_id)
            raise
        with self._lock:
            self._by_id[reg.registration_id] = reg
            others = list(self._by_id.values())
        if reg.is_cuda:  # the first copies pay nothing a registration could have paid
            open_peer_mappings(reg, others)
        return reg

    @staticmethod
    def _memory_keys(layout: KVLayout, fds: Sequence[int]) -> list[tuple[tuple[int, int], str]]:
        """The host memory a layout names (its CPU regions' and its generations' descriptors),
        as (identity, what) pairs; RegistryError for memory named otherwise."""
        named = [] if layout.device != "cpu" else \
            [(r.handle, f"region {i}") for i, r in enumerate(layout.regions)]
        if layout.generations is not None:
            named.append((layout.generations, "block generations"))
        return [(memory_key(fd_of(handle, fds, what), what), what) for handle, what in named]

    @staticmethod
    def _map_generations(reg: Registration, fd: int) -> None:
        mapping = map_fd(fd, False, "block generations")
        needed, size = reg.layout.num_blocks * GENERATION_BYTES, len(mapping)
        if size < needed:
            mapping.close()
            raise RegistryError("bad_request", f"block generations hold {size} bytes, "
                                f"{reg.layout.num_blocks} blocks need {needed}")
        reg.attach_generations(mapping)

    def _copier(self, device_id: int) -> CudaCopier:
        # A device new to the daemon gets its CUDA context (1-2 s) before the lock is taken:
        # verbs answered on the control loop (resident, evicted, lookups) take the lock too.
        hold_primary_context(device_id)
        with self._lock:
            copier = self._copiers.get(device_id)
            made = copier is None
            if copier is None:
                copier = self._copiers[device_id] = CudaCopier(device_id, self.copy_settings,
                                                                self.cuda_fault)
        if made:  # once per device, outside the lock: its kernels loaded before a copy needs them
            try:
                warm_copier(copier)
            except Exception as exc:
                self.cuda_fault.observe(exc, "warming up the copier")
                log.warning("warm-up of device %d's copier failed: %s", device_id, exc)
        return copier

    def get(self, registration_id: int, owner: str) -> Registration:
        with self._lock:
            reg = self._by_id.get(registration_id)
        if reg is None or reg.owner != owner:
            raise RegistryError("not_found", f"no registration {registration_id} on this "
                                "connection")
        return reg

    def of_owner(self, owner: str) -> list[Registration]:
        """The open registrations of one connection."""
        with self._lock:
            return [r for r in self._by_id.values() if r.owner == owner]

    def unregister(self, registration_id: int, owner: str) -> bool:
        with self._lock:
            reg = self._by_id.get(registration_id)
            if reg is None or reg.owner != owner:
                return False
            del self._by_id[registration_id]
        self._close(reg)
        return True

    def drop_owner(self, owner: str) -> int:
        """Close every registration of ``owner`` (its connection closed); returns how many."""
        try:
            with self._lock:
                regs = [r for r in self._by_id.values() if r.owner == owner]
                for reg in regs:
                    del self._by_id[reg.registration_id]
            for reg in regs:
                self._close(reg)
            return len(regs)
        finally:
            self._leaving.gone(owner)

    def close_all(self) -> None:
        with self._lock:
            regs = list(self._by_id.values())
            self._by_id.clear()
        for reg in regs:
            self._close(reg)

    def add_close_listener(self, listener: CloseListener) -> None:
        """From now on tell ``listener(registration)`` of every registration that leaves
        (unregistered, its connection closed, shutdown), after it closed: the HBM tier forgets
        its blocks. A listener's failure is logged; the registration is gone either way."""
        self._close_listeners.add(listener)

    def _close(self, reg: Registration) -> None:
        reg.close()  # a copy that checks ``closed`` after this fails its block; the memory's
        self._close_listeners.tell(reg)  # claims go back once the last copy is done

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    def copier_counts(self) -> dict[str, int]:
        """How the device copiers' whole-block batches went (packed or not, and why), summed
        over devices; empty where no GPU engine registered."""
        total: Counter[str] = Counter()
        for copier in self._copiers_now():
            total.update(copier.counts)
        return dict(total)

    def copy_timing(self) -> dict[str, dict[str, float]]:
        """Where the devices' whole-block saves and loads spent their time (``CopyTiming``),
        summed over devices; empty where no GPU engine registered."""
        return CopyTiming.merged([copier.timing.snapshot() for copier in self._copiers_now()])

    def _copiers_now(self) -> list[CudaCopier]:
        with self._lock:
            return list(self._copiers.values())

    def describe(self) -> list[dict]:
        with self._lock:
            regs = list(self._by_id.values())
        return [{"registration_id": r.registration_id, "engine_id": r.engine_id,
                 "num_blocks": r.num_blocks, "block_bytes": r.block_bytes, "device":
                 r.layout.device, "publishes_resident": r.has_generations,
                 # what the engine declared its block keys are made of (a hosted engine's
                 # connector does): plain data from the client, read by whoever keys its blocks
                 "model_identity": r.layout.meta.get("model_identity"),
                 "num_shards": r.layout.meta.get("num_shards", 1)} for r in regs]
