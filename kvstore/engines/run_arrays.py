"""Copy runs as NumPy arrays: a registration's piece table, built once, and chunks of blocks.

A block of a registration is its regions' pieces concatenated in region order (``KVLayout``).
``PieceTable`` keeps, per region, the device address of block 0's piece, the stride between
blocks and the piece size, plus each piece's offset inside the block's host bytes; the runs of a
chunk of blocks are then one broadcast (block ids x pieces) instead of a Python object per piece
(vLLM's layout has 72 pieces of 32 KiB per 2.36 MB block). Runs come out in the order the
per-piece construction gave them (block by block, region by region) and coalesced the same way.
NumPy only: the CPU tests check it against that construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.layout import KVLayout


@dataclass(frozen=True)
class CopyRun:
    """``num_bytes`` from ``src_ptr`` to ``dst_ptr`` (plain integers: device or host addresses)."""

    src_ptr: int
    dst_ptr: int
    num_bytes: int


def coalesce(runs: Iterable[CopyRun]) -> list[CopyRun]:
    """Merge runs that continue each other on both sides, keeping the given order."""
    out: list[CopyRun] = []
    for run in runs:
        if run.num_bytes <= 0:
            continue
        if out:
            last = out[-1]
            if (last.src_ptr + last.num_bytes == run.src_ptr
                    and last.dst_ptr + last.num_bytes == run.dst_ptr):
                out[-1] = CopyRun(last.src_ptr, last.dst_ptr, last.num_bytes + run.num_bytes)
                continue
        out.append(run)
    return out


@dataclass(frozen=True, eq=False)
class RunArrays:
    """``num_bytes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` (int64 addresses)."""

    src_ptrs: np.ndarray
    dst_ptrs: np.ndarray
    num_bytes: np.ndarray
    coalesced: bool = False  # already merged: a copier need not merge it again

    def __len__(self) -> int:
        return len(self.num_bytes)

    @property
    def total_bytes(self) -> int:
        return int(self.num_bytes.sum())

    @classmethod
    def of(cls, runs: Iterable) -> RunArrays:
        """From objects with ``src_ptr``, ``dst_ptr`` and ``num_bytes`` (``CopyRun``)."""
        triples = [(r.src_ptr, r.dst_ptr, r.num_bytes) for r in runs]
        table = np.array(triples, dtype=np.int64).reshape(-1, 3)
        return cls(table[:, 0].copy(), table[:, 1].copy(), table[:, 2].copy())

    def triples(self) -> list[tuple[int, int, int]]:
        """(src, dst, bytes) per run, as Python ints."""
        return list(zip(self.src_ptrs.tolist(), self.dst_ptrs.tolist(),
                        self.num_bytes.tolist(), strict=True))


def coalesce_arrays(runs: RunArrays) -> RunArrays:
    """Drop empty runs and merge runs that continue each other on both sides, keeping order
    (the vectorised ``coalesce``)."""
    if runs.coalesced:
        return runs
    keep = runs.num_bytes > 0
    src, dst, size = runs.src_ptrs[keep], runs.dst_ptrs[keep], runs.num_bytes[keep]
    if len(size) < 2:
        return RunArrays(src, dst, size, coalesced=True)
    follows = (src[:-1] + size[:-1] == src[1:]) & (dst[:-1] + size[:-1] == dst[1:])
    if not follows.any():
        return RunArrays(src, dst, size, coalesced=True)
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    return RunArrays(src[starts], dst[starts], np.add.reduceat(size, starts), coalesced=True)


class PieceTable:
    """Where each of a registration's block pieces lives, as arrays computed once."""

    def __init__(self, layout: KVLayout, region_ptrs: Sequence[int]) -> None:
        if len(region_ptrs) != len(layout.regions):
            raise ValueError(f"{len(region_ptrs)} region addresses for "
                             f"{len(layout.regions)} regions")
        regions = layout.regions
        self.block_bytes = layout.block_bytes
        self.num_blocks = layout.num_blocks
        self.piece_bytes = np.array([r.block_bytes for r in regions], dtype=np.int64)
        self.device_base = np.array([int(p) + r.offset for r, p in zip(regions, region_ptrs)],
                                    dtype=np.int64)
        self.device_stride = np.array([r.block_stride for r in regions], dtype=np.int64)
        self.host_offset = np.concatenate(([0], np.cumsum(self.piece_bytes)[:-1])).astype(
            np.int64)

    @property
    def num_pieces(self) -> int:
        return len(self.piece_bytes)

    def device_ptrs(self, block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """int64 ``[len(block_ids), num_pieces]``: each block's piece addresses."""
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1, 1)
        return self.device_base + ids * self.device_stride

    def runs(self, block_ids: Sequence[int] | np.ndarray,
             host_addrs: Sequence[int] | np.ndarray, to_device: bool) -> RunArrays:
        """The coalesced runs moving each ``block_ids[i]`` between its device pieces and the
        ``block_bytes`` at ``host_addrs[i]``; ``to_device``: host is the source."""
        dev = self.device_ptrs(block_ids).ravel()
        host = (np.asarray(host_addrs, dtype=np.int64).reshape(-1, 1)
                + self.host_offset).ravel()
        if len(dev) != len(host):
            raise ValueError(f"{len(host) // max(1, self.num_pieces)} host addresses for "
                             f"{len(dev) // max(1, self.num_pieces)} blocks")
        size = np.broadcast_to(self.piece_bytes, (len(dev) // max(1, self.num_pieces),
                                                  self.num_pieces)).ravel()
        src, dst = (host, dev) if to_device else (dev, host)
        return coalesce_arrays(RunArrays(src, dst, size))
