"""How block bytes get between a hosting engine's KV tensors and the blocks the daemon copies.

``DirectMover`` (GPU): the daemon maps each layer's tensor through CUDA IPC and copies whole
blocks itself, with the engine's own block ids. ``StagedMover`` (CPU): the engine's tensors are
ordinary process memory, so blocks go through a registered ``StagingBuffer`` (see there for
why). Both describe the engine's tensors with the same ``Piece`` list per layer
(``tensor_layout``).
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np

from kvstore.layout import KVLayout, Region
from offload.core.block_site import BlockSite
from offload.core.restore_job import RestoreJob
from offload.core.slots import Reservation, Slots
from offload.external.plan import BlockTransfer
from offload.external.staging import StagingBuffer
from offload.external.tensor_layout import Piece


class BlockMover(BlockSite[BlockTransfer]):
    """The engine's blocks as the core's ``BlockSite``, built from four primitives:
    ``open()`` makes the layout to register (called on every (re)connect);
    ``slots_for(ids, copy_out)`` returns daemon block ids for the engine's blocks ``ids`` (with
    ``copy_out``, holding their bytes for a save), or None when there is no room;
    ``copy_in(slots, ids, n)`` makes the first ``n`` loaded blocks visible in the engine's
    blocks ``ids``; ``give_back(slots)`` returns ids once
    the daemon is done with them. Slots a request without a reply holds come back once a newer
    registration was accepted (``Quarantine``); a mover that registers fresh memory per
    connection (``StagedMover``) ignores those of memory it abandoned."""

    meta: dict  # what the registration's meta says (num_layers, tensor_layout...)

    #: The most blocks one save request carries. Staged movers copy into a bounded buffer per
    #: save: short requests. A direct mover's save is the daemon's batched copy of the engine's
    #: own blocks: one request per step and engine request, up to this bound (many short requests in
    #: flight at once move far less than one long one: docs/measurements.md).
    max_save_blocks: int = 64
    #: The most slots saves may hold at once (None: no bound, the direct mover's own blocks):
    #: the rest of a staging buffer stays for loads. A save past it waits for room.
    save_room: int | None = None
    _save_slots: int = 0  # slots saves hold now

    @abstractmethod
    def open(self) -> KVLayout: ...

    @abstractmethod
    def registered(self) -> None:
        """The daemon has answered the registration of ``open()``'s layout (or refused it)."""

    @abstractmethod
    def slots_for(self, block_ids: list[int], copy_out: bool) -> Slots | None: ...

    @abstractmethod
    def copy_in(self, slots: Slots, block_ids: list[int], num_loaded: int) -> None: ...

    @abstractmethod
    def give_back(self, slots: Slots) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Drop what ``open`` made."""

    # -- the BlockSite contract -------------------------------------------------------------

    def reserve(self, job: RestoreJob[BlockTransfer]) -> Slots | Reservation:
        slots = self.slots_for(job.owner.block_ids[:job.num_hit], copy_out=False)
        return Reservation.WAIT if slots is None else slots

    def reserve_ahead(self, owner: BlockTransfer, first_block: int,
                      num_blocks: int) -> Slots | None:
        return self.slots_for(owner.block_ids[first_block:first_block + num_blocks],
                              copy_out=False)

    def land(self, job: RestoreJob[BlockTransfer], num_loaded: int) -> None:
        assert job.slots is not None
        self.copy_in(job.slots, job.owner.block_ids, num_loaded)
        self.give_back(job.slots)

    def unreserve(self, job: RestoreJob[BlockTransfer], quarantined: bool) -> None:
        if not quarantined and job.slots is not None:
            self.give_back(job.slots)

    def release(self, slots: Slots) -> None:
        self.give_back(slots)

    def pin_for_save(self, block_ids: list[int]) -> Slots | Reservation:
        """Slots holding a copy (staged) or naming the blocks (direct); WAIT while saves hold
        ``save_room`` or the buffer has no free slot (saves and loads in flight give theirs
        back); REFUSE for more blocks than ``save_room`` could ever hold."""
        room = self.save_room
        if self.never_fits(len(block_ids)):
            return Reservation.REFUSE
        if room is not None and self._save_slots + len(block_ids) > room:
            return Reservation.WAIT
        slots = self.slots_for(block_ids, copy_out=True)
        if slots is None:
            return Reservation.WAIT
        if room is not None:
            self._save_slots += len(slots.block_ids)
        return slots

    def _size_saves(self, room: int, most: int) -> None:
        """Saves may hold ``room`` slots at once, in requests of half of it (at most
        ``most`` blocks): one is copied while the other is sent."""
        self.save_room = room
        self.max_save_blocks = max(1, min(most, room // 2))

    def never_fits(self, num_blocks: int) -> bool:
        return self.save_room is not None and num_blocks > self.save_room

    def unpin_after_save(self, slots: Slots) -> None:
        if self.save_room is not None:
            self._save_slots -= len(slots.block_ids)
        self.give_back(slots)


class DirectMover(BlockMover):
    """The daemon copies the engine's blocks itself (CUDA IPC regions built by the caller)."""

    max_save_blocks = 1024

    def __init__(self, layout: KVLayout) -> None:
        layout.validate()
        self.layout = layout
        self.meta = layout.meta

    def open(self) -> KVLayout:
        return self.layout

    def registered(self) -> None:
        pass

    def slots_for(self, block_ids: list[int], copy_out: bool) -> Slots | None:
        return Slots(list(block_ids))

    def copy_in(self, slots: Slots, block_ids: list[int], num_loaded: int) -> None:
        pass  # the daemon wrote into the engine's blocks

    def give_back(self, slots: Slots) -> None:
        pass

    def close(self) -> None:
        pass  # the memory is the engine's


class StagedMover(BlockMover):
    """Copies between the engine's host tensors (byte views, one per layer) and staging
    slots."""

    def __init__(self, layer_bytes: list[np.ndarray], layer_pieces: list[list[Piece]],
                 num_blocks: int, num_slots: int, dtype: str, meta: dict,
                 save_room: int | None = None) -> None:
        """``save_room``: the slots saves may hold at once (default: all of them)."""
        if len(layer_bytes) != len(layer_pieces) or not layer_bytes:
            raise ValueError("one byte view and one piece list per layer")
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self._size_saves(num_slots if save_room is None else min(save_room, num_slots),
                         BlockMover.max_save_blocks)
        self.dtype = dtype
        self.meta = meta
        # Per piece: a [num_blocks, piece_bytes] strided view of the engine's memory and its columns
        # in a staged block.
        self._views: list[tuple[np.ndarray, int, int]] = []
        col = 0
        for buf, pieces in zip(layer_bytes, layer_pieces):
            for p in pieces:
                end = p.offset + (num_blocks - 1) * p.block_stride + p.block_bytes
                if end > buf.nbytes:
                    raise ValueError(f"piece at {p.offset} ends at {end}, past its "
                                     f"{buf.nbytes}-byte layer")
                view = np.lib.stride_tricks.as_strided(
                    buf[p.offset:], shape=(num_blocks, p.block_bytes),
                    strides=(p.block_stride, 1), writeable=True)
                self._views.append((view, col, col + p.block_bytes))
                col += p.block_bytes
        self.block_bytes = col
        self.buffer: StagingBuffer | None = None

    def open(self) -> KVLayout:
        if self.buffer is not None:
            self.buffer.drop_fd()  # abandoned: jobs that still hold it finish on it
        self.buffer = StagingBuffer(self.num_slots, self.block_bytes)
        return self.buffer.layout(self.dtype, self.meta)

    def registered(self) -> None:
        # The daemon mapped the memory from the descriptor the registration sent: ours can go
        # (a reconnect registers a fresh buffer).
        if self.buffer is not None:
            self.buffer.drop_fd()

    def _check(self, block_ids: list[int]) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.intp)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise ValueError(f"block ids outside 0..{self.num_blocks - 1}")
        return ids

    def slots_for(self, block_ids: list[int], copy_out: bool) -> Slots | None:
        buf = self.buffer
        ids = self._check(block_ids)
        got = buf.take(len(block_ids)) if buf is not None else None
        if got is None:
            return None
        if copy_out:
            rows = np.asarray(got, dtype=np.intp)
            for view, lo, hi in self._views:
                buf.slots[rows, lo:hi] = view[ids]
        return Slots(got, buf)

    def copy_in(self, slots: Slots, block_ids: list[int], num_loaded: int) -> None:
        if num_loaded <= 0:
            return
        ids = self._check(block_ids[:num_loaded])
        rows = np.asarray(slots.block_ids[:num_loaded], dtype=np.intp)
        for view, lo, hi in self._views:
            view[ids] = slots.memory.slots[rows, lo:hi]

    def give_back(self, slots: Slots) -> None:
        if slots.memory is not None and slots.memory is self.buffer:
            slots.memory.give_back(slots.block_ids)

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.drop_fd()
            self.buffer = None


def direct_layout(handles: list[bytes], buffer_bytes: list[int], layer_pieces: list[list[Piece]],
                  num_blocks: int, device: str, dtype: str, meta: dict) -> KVLayout:
    """The registration of the engine's device tensors: one region per piece of each layer, naming
    that layer's CUDA IPC handle (offsets are within the IPC allocation)."""
    regions = []
    for handle, size, pieces in zip(handles, buffer_bytes, layer_pieces):
        for p in pieces:
            regions.append(Region(handle=handle, size_bytes=size, offset=p.offset,
                                  block_stride=p.block_stride, block_bytes=p.block_bytes))
    return KVLayout(num_blocks=num_blocks, regions=tuple(regions), device=device, dtype=dtype,
                    meta=meta)
