"""``DeviceStagedMover``: a hosting engine's GPU blocks moved through ``DeviceStaging`` slots.

The daemon sees the staging buffer as the registration (slot ids are its block ids) and moves
whole blocks between the slots and its DRAM pool, one DMA run a block. The worker packs a save's
blocks into slots on a stream of its own, behind the step that computed them (the save goes out
once that launch completed: ``Slots.ready``), and scatters a load's slots into the engine's
blocks on its current stream, before any later forward; slots go back once the launch that used
them completed. Slots lent to a request that got no reply (its connection lost, its deadline
passed) stay out of use until the same buffer's next registration was accepted: the daemon
holds a registered IPC handle until its last copy is done, so no copy of the old registration
still reads or writes them then (``Quarantine``).
"""

from __future__ import annotations

from kvstore.layout import KVLayout
from offload.core.slots import Slots
from offload.external.block_mover import BlockMover
from offload.external.device_staging import DeviceStaging


class DeviceStagedMover(BlockMover):
    """The engine's device blocks through ``staging`` (one buffer for the mover's life)."""

    def __init__(self, staging: DeviceStaging, num_blocks: int, dtype: str, meta: dict,
                 save_room: int) -> None:
        """``save_room``: the slots saves may hold at once (the rest stays for loads); two
        saves of half of it each may be in flight, so one packs while the daemon moves the
        other."""
        self.staging = staging
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.meta = meta
        self.block_bytes = staging.block_bytes
        self._size_saves(max(1, min(save_room, staging.num_slots)), 1024)

    def open(self) -> KVLayout:
        return self.staging.layout(self.dtype, self.meta)

    def registered(self) -> None:
        pass  # the buffer is registered again on a reconnect: its IPC handle stays valid

    def _check(self, block_ids: list[int]) -> None:
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"block ids outside 0..{self.num_blocks - 1}")

    def slots_for(self, block_ids: list[int], copy_out: bool) -> Slots | None:
        self._check(block_ids)
        got = self.staging.take(len(block_ids))
        if got is None:
            return None
        ready = self.staging.pack(block_ids, got) if copy_out else None
        return Slots(got, self.staging, ready)

    def copy_in(self, slots: Slots, block_ids: list[int], num_loaded: int) -> None:
        if num_loaded <= 0:
            return
        self._check(block_ids[:num_loaded])
        self.staging.unpack(slots.block_ids[:num_loaded], block_ids[:num_loaded])

    def give_back(self, slots: Slots) -> None:
        if slots.memory is self.staging:
            self.staging.give_back(slots.block_ids)

    def close(self) -> None:
        pass  # the buffer is torch's: freed with the mover
