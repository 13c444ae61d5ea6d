"""Where an engine's blocks land and how they are held: the one thing the engines do apart.

kvengine's site is its block ledger (``offload.ledger_site``): a load lands in blocks reserved
for the request, and a save pins the request's blocks. vLLM's (any hosting engine's) is its
block mover (``offload.external.block_mover``): a load lands in staging slots (CPU) or the
engine's own blocks (GPU), and a save copies into staging slots or reads its blocks in place.
The ``Restorer`` and the ``Saver`` call nothing else of an engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic

from offload.core.restore_job import Owner, RestoreJob
from offload.core.slots import Reservation, Slots


class BlockSite(ABC, Generic[Owner]):
    """Contract (step thread only; every method returns without waiting on the store):

    - ``reserve(job)`` lends slots for ``job.num_hit`` blocks, in chain order, or says WAIT or
      REFUSE. A reservation is undone by exactly one of ``land`` and ``unreserve``.
    - ``land(job, n)``: the daemon answered the load: the first ``n`` slots hold their blocks
      (``n`` may be 0); make them the owner's, and take the slots back.
    - ``unreserve(job, quarantined)``: the load will not land (given up, aborted). With
      ``quarantined`` the daemon may still write into ``job.slots``: keep them out of use until
      ``release`` is called for them (which may be never: a request that got no reply).
    - ``reserve_ahead(owner, first_block, num_blocks)``: slots for all ``num_blocks`` blocks of
      the owner's chain from ``first_block``, before the lookup is answered (the daemon loads
      the hit into them in the same round trip), or None: no room, or a site that does not
      reserve ahead (the default). Undone like a ``reserve``'s.
    - ``release(slots)``: the daemon is done with quarantined slots; they may be reused (the
      quarantine calls it once the request was answered, or once a newer registration of
      the site's memory was accepted: the daemon then has no copy of the old one running).
    - ``pin_for_save(block_ids)``: slots holding the owner's ``block_ids`` (pinned, or copied
      out) for a save; or WAIT: no room now, ask again later (the owner keeps the blocks
      meanwhile); or REFUSE: never (the save is skipped, counted).
    - ``unpin_after_save(slots)``: the save ended and the daemon reads the slots no more: it
      answered, or the save got no reply and a newer registration of the site's memory has
      been accepted since (``Quarantine``; the daemon publishes the copies it had in flight
      when a connection went, so slots reused before then could be stored torn).
    - ``never_fits(num_blocks)``: a save of that many blocks would be refused whatever is free
      (``pin_for_save`` says REFUSE); by default never."""

    @abstractmethod
    def reserve(self, job: RestoreJob[Owner]) -> Slots | Reservation: ...

    def reserve_ahead(self, owner: Owner, first_block: int, num_blocks: int) -> Slots | None:
        return None

    @abstractmethod
    def land(self, job: RestoreJob[Owner], num_loaded: int) -> None: ...

    @abstractmethod
    def unreserve(self, job: RestoreJob[Owner], quarantined: bool) -> None: ...

    @abstractmethod
    def release(self, slots: Slots) -> None: ...

    @abstractmethod
    def pin_for_save(self, block_ids: list[int]) -> Slots | Reservation: ...

    @abstractmethod
    def unpin_after_save(self, slots: Slots) -> None: ...

    def never_fits(self, num_blocks: int) -> bool:
        return False
