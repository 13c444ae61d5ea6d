"""HBM-tier copies: blocks from other engines' arenas into a requester's, checked by generation.

The owner of a source block is never stalled: nothing pins its blocks. Instead every block is
copied seqlock-style. Its generation is read before the copy is issued and again after the copy
has completed (on GPU: after the copy's CUDA event); the owner bumps a block's generation before
anything may write the block again, so an unchanged generation after the copy proves the bytes
copied were the published ones. A changed one (or a closed source registration) fails that block:
the count of copied blocks stops before it, so the requester's hit shrinks and nothing it uses
is wrong. Blocks after a failed one may have been written into the requester's blocks but are not
counted (the requester recomputes them).

CPU: a memcpy between the two shared-memory mappings. GPU: device to device on the destination
device's copy stream, one submission per source registration (addresses and generation checks
as arrays), completion by event. Across GPUs the source's regions are read through a mapping
opened on the destination device (``CudaRegistration.device_ptrs``) and the copy engines move
them (a ``cudaMemcpyAsync`` a run: 242 GB/s over NVLink on H200s, the gather kernel 157-187).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.engines.copier import CopyHandle
from kvstore.engines.cuda_ipc import can_access_peer
from kvstore.engines.hbm.index import HbmEntry
from kvstore.engines.hbm.outcome import BlockOutcome
from kvstore.engines.registration import Registration, RegistrationClosed
from kvstore.engines.run_arrays import RunArrays

log = logging.getLogger(__name__)

@dataclass
class CopyOutcome:
    """``num_copied`` leading blocks arrived intact; ``failure`` says why the rest did not
    (None: nothing failed); ``stale`` is the entry whose generation check failed (to be
    dropped from the index)."""

    num_copied: int
    failure: BlockOutcome | None = None
    stale: HbmEntry | None = None


def compatible(src: Registration, dst: Registration) -> bool:
    """Blocks of ``src`` can be copied into ``dst``: same piece sizes, both in host shared
    memory, or both on CUDA devices that can reach each other."""
    if src.is_cuda != dst.is_cuda:
        return False
    if [r.block_bytes for r in src.layout.regions] != [r.block_bytes for r in dst.layout.regions]:
        return False
    if src.is_cuda:
        return can_access_peer(dst.device_id, src.device_id)
    return True


def copy_blocks(sources: Sequence[HbmEntry], dst: Registration, dst_ids: Sequence[int],
                stopped: Callable[[], bool],
                after_copy: Callable[[int], None] | None = None) -> CopyOutcome:
    """Copy each source block into ``dst`` block ``dst_ids[i]``, in order; call inside
    ``dst.open_for_copy()`` with the ids checked. Returns only once no copy is in flight.

    ``after_copy(i)`` (tests) runs once block ``i``'s bytes (GPU: its chunk's) have landed,
    before their generations are checked again.
    """
    with contextlib.ExitStack() as stack:
        opened: set[int] = set()

        def check(entry: HbmEntry) -> BlockOutcome | None:
            """Whether block copying may start: None, or why not."""
            reg = entry.reg
            if reg.registration_id not in opened:
                if not compatible(reg, dst):
                    return BlockOutcome.INCOMPATIBLE
                try:
                    stack.enter_context(reg.open_for_copy())
                except RegistrationClosed:
                    return BlockOutcome.OWNER_CLOSED
                opened.add(reg.registration_id)
            if not entry.current():
                return _stale_reason(reg)
            return None

        if dst.is_cuda:
            return _copy_cuda(sources, dst, dst_ids, stopped, check, after_copy)
        return _copy_host(sources, dst, dst_ids, stopped, check, after_copy)


def _stale_reason(reg: Registration) -> BlockOutcome:
    """Why a block's generation check failed: its owner closed, or it reallocated the block."""
    return BlockOutcome.OWNER_CLOSED if reg.closed else BlockOutcome.GENERATION


def _after_failure(entry: HbmEntry, reason: BlockOutcome, num_copied: int) -> CopyOutcome:
    return CopyOutcome(num_copied, reason,
                       entry if reason is BlockOutcome.GENERATION else None)


def _verify(entry: HbmEntry) -> BlockOutcome | None:
    """After the copy landed: None if the block was the published one throughout."""
    if entry.current():
        return None
    return _stale_reason(entry.reg)


def _copy_host(sources: Sequence[HbmEntry], dst: Registration, dst_ids: Sequence[int],
               stopped: Callable[[], bool], check: Callable[[HbmEntry], BlockOutcome | None],
               after_copy: Callable[[int], None] | None) -> CopyOutcome:
    for i, (entry, dst_id) in enumerate(zip(sources, dst_ids)):
        if stopped():
            return CopyOutcome(i, BlockOutcome.STOPPED)
        reason = check(entry)
        if reason is not None:
            return _after_failure(entry, reason, i)
        for src_piece, dst_piece in zip(entry.reg.piece_views(entry.block_id),
                                        dst.piece_views(dst_id)):
            dst_piece[:] = src_piece
        if after_copy is not None:
            after_copy(i)
        reason = _verify(entry)
        if reason is not None:
            return _after_failure(entry, reason, i)
    return CopyOutcome(len(sources))


@dataclass(eq=False)
class _Group:
    """Sources ``start .. end - 1``: blocks of one registration, submitted as one copy."""

    start: int
    end: int
    reg: Registration
    block_ids: np.ndarray
    generations: np.ndarray
    handle: CopyHandle | None = None


def _first_stale(group: _Group) -> int | None:
    """The index (into the sources) of the group's first block whose generation moved since
    it was published (or all of them once the registration closed); None if none did."""
    now = group.reg.generations_of(group.block_ids)
    if now is None:
        return group.start
    moved = np.flatnonzero(now != group.generations)
    return group.start + int(moved[0]) if len(moved) else None


def _copy_cuda(sources: Sequence[HbmEntry], dst: Registration, dst_ids: Sequence[int],
               stopped: Callable[[], bool], check: Callable[[HbmEntry], BlockOutcome | None],
               after_copy: Callable[[int], None] | None) -> CopyOutcome:
    """One submission per run of sources from one registration, every per-block step (the
    generation checks, the addresses) as arrays: at HBM speed a block copies in about a
    microsecond, so Python per block, not the copy, was the load's time."""
    num_blocks = len(sources)
    dst_ptrs = dst.device_ptrs(np.asarray(dst_ids, dtype=np.int64))
    sizes = np.array([r.block_bytes for r in dst.layout.regions], dtype=np.int64)
    groups: list[_Group] = []
    # Submission stops at the first block that may not be copied; what is before it counts.
    early: CopyOutcome | None = None
    try:
        i = 0
        while i < num_blocks and early is None:
            if stopped():
                early = CopyOutcome(i, BlockOutcome.STOPPED)
                break
            reason = check(sources[i])  # opens the registration, or says why not
            if reason is not None:
                early = _after_failure(sources[i], reason, i)
                break
            reg, end = sources[i].reg, i + 1
            while end < num_blocks and sources[end].reg is reg:
                end += 1
            group = _Group(i, end, reg,
                           np.array([e.block_id for e in sources[i:end]], dtype=np.int64),
                           np.array([e.generation for e in sources[i:end]], dtype=np.int64))
            stale = _first_stale(group)
            if stale is not None:  # copy what came before it, then stop there
                early = _after_failure(sources[stale], _stale_reason(reg), stale)
                group = _Group(i, stale, reg, group.block_ids[:stale - i],
                               group.generations[:stale - i])
                if stale == i:
                    break
            try:
                src_ptrs = reg.device_ptrs(group.block_ids, dst.device_id)
            except Exception as exc:  # the source cannot be opened on this device
                log.warning("blocks of engine %s cannot be read from device %d: %s",
                            reg.engine_id, dst.device_id, exc)
                early = CopyOutcome(i, BlockOutcome.INCOMPATIBLE)
                break
            runs = RunArrays(src_ptrs.ravel(), dst_ptrs[group.start:group.end].ravel(),
                             np.broadcast_to(sizes, src_ptrs.shape).ravel())
            try:
                group.handle = dst.copier.device_to_device(runs, reg.device_id != dst.device_id)
            except Exception as exc:  # the copier waited out what it had enqueued
                log.error("submitting %d device-to-device block copies failed: %s",
                          group.end - group.start, exc)
                early = CopyOutcome(group.start, BlockOutcome.COPY_ERROR)
                break
            groups.append(group)
            i = group.end
        # Count in order: a group's blocks are checked again once its event has completed.
        for group in groups:
            assert group.handle is not None
            try:
                group.handle.wait()
            except Exception as exc:  # a CUDA error surfaces at the event
                log.error("device-to-device block copies failed: %s", exc)
                return CopyOutcome(group.start, BlockOutcome.COPY_ERROR)
            if after_copy is not None:
                after_copy(group.start)
            stale = _first_stale(group)
            if stale is not None:
                return _after_failure(sources[stale], _stale_reason(group.reg), stale)
        return early if early is not None else CopyOutcome(num_blocks)
    finally:
        for group in groups:  # whatever happened, no copy is in flight once this returns
            if group.handle is not None:
                with contextlib.suppress(Exception):
                    group.handle.wait()
