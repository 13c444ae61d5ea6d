"""Slots a request may still touch: held out of use until the daemon is done with them.

A load given up before its reply (the store hung, the deadline passed) leaves the daemon free to
write into its slots later; a save that got no reply, to read them. They stay here. Once the
reply does come in (or the request turns out never to have been sent) the daemon is done with
them and the site gets them back. A request that ended with no reply at all (its connection
lost, its deadline passed) holds them until a later registration of the engine's memory has
been accepted: the daemon holds a registration's memory until its last copy is done (a second
registration of it is refused meanwhile), so by then no copy of the old one reads or writes the
slots. The link's ``registration_epoch`` counts those accepted registrations. Or until the
daemon's process has exited (``Transfer.daemon_exited``): a daemon killed outright never
registers the engine again, and its copies ended with it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from offload.core.block_site import BlockSite
from offload.core.slots import Slots
from offload.transfer import Transfer


@dataclass
class _Held:
    request: Transfer
    slots: Slots
    release: Callable[[Slots], None]  # how the slots go back
    unanswered: bool = False  # ended without a reply (counted once): waits for a registration


class Quarantine:
    """Held slots per request given up (step thread only)."""

    def __init__(self, site: BlockSite, counters: Counter[str],
                 registration_epoch: Callable[[], int]) -> None:
        self.site = site
        self.counters = counters
        self.registration_epoch = registration_epoch
        self._held: list[_Held] = []

    def hold(self, request: Transfer, slots: Slots,
             release: Callable[[Slots], None] | None = None) -> None:
        """Keep ``slots`` out of use until the daemon is done with them; then ``release``
        them (default: the site's ``release``)."""
        self.counters["blocks_quarantined"] += len(slots.block_ids)
        self._held.append(_Held(request, slots, release or self.site.release))
        self.poll()

    def poll(self) -> None:
        """Give back the slots of requests the daemon has answered since, whose connection
        a newer accepted registration replaced, or whose daemon's process has exited."""
        still = []
        for held in self._held:
            request, num = held.request, len(held.slots.block_ids)
            if not request.poll():
                still.append(held)
            elif request.answered or request.never_sent:
                held.release(held.slots)
                self.counters["blocks_quarantine_released"] += num
            elif (request.sent_epoch is not None
                  and self.registration_epoch() > request.sent_epoch):
                held.release(held.slots)
                self.counters["blocks_quarantine_released_after_reconnect"] += num
            elif request.daemon_exited:
                held.release(held.slots)
                self.counters["blocks_quarantine_released_daemon_exited"] += num
            else:
                if not held.unanswered:
                    held.unanswered = True
                    self.counters["blocks_quarantined_until_reconnect"] += num
                still.append(held)
        self._held = still

    @property
    def num_held(self) -> int:
        """Blocks held now (waiting for a reply or for a newer registration)."""
        return sum(len(held.slots.block_ids) for held in self._held)
