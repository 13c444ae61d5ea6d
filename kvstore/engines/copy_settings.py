"""How the daemon's GPU copies go: one frozen value, validated once, handed to every copier.

``kvstore serve --copy-*`` sets it (``kvstore/cli/copies.py``); the defaults are the methods that
measured fastest on an H100 (figures in README, "The daemon"; ``benchmarks/copy_paths.py``).
Benchmarks compare the other choices by starting daemons with other flags.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kernels.block_copy import UNROLL, UNROLLS

DEFAULT_CHUNK_BYTES = 32 << 20
DEFAULT_LOAD_CHUNK_BYTES = 128 << 20
# A staging slot holds one default save chunk (a load's larger chunks go through it in parts): 4
# slots per direction are at most 128 MiB of the engine's HBM, whatever size of batch the copier
# is handed.
DEFAULT_STAGING_SLOT_BYTES = 32 << 20


class CopyMethod(str, enum.Enum):
    """How a host <-> device batch of runs crosses the bus (a method the batch cannot take falls
    back: unaligned runs, pageable host memory, an old driver)."""

    STAGED = "staged"  # gathered on the GPU into a staging slot, across the bus a run per block
    KERNEL = "kernel"  # one copy_runs launch reading or writing the mapped pinned pool
    BATCH = "batch"  # one cuMemcpyBatchAsync driver call for the whole batch
    MEMCPY = "memcpy"  # a cudaMemcpyAsync per run

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class CopySettings:
    """``small_runs``: the method for batches of many small runs (vLLM's 32 KiB pieces: a copy
    engine call per piece pays microseconds each); ``large_runs``: for the rest (kvengine's
    block-major 2+ MB blocks, which the copy engines move near the bus's rate).
    ``packed_min_pieces``: whole blocks of a layout with at least this many pieces per block are
    packed on the GPU from a table of block ids (``copy_pieces``), never a run built per piece.
    ``chunk_bytes``: a save is cut into submissions of at most this many bytes, 2, 4, 8 ...
    blocks, so the next chunk is prepared while one copies (0: each save is one submission).
    ``load_growth``, ``load_chunk_bytes``: a load's chunks are ``load_growth``,
    ``load_growth``² ... blocks up to ``load_chunk_bytes`` (0: one submission): its next
    chunk costs only its submission (its blocks' addresses come from one store call), which a
    chunk that many times smaller hides behind its copy, where a save's also reserves a slot per
    block. Fewer submissions leave the copy engine fewer gaps: a 64-block load of 2.36 MB blocks
    went in 7 chunks with a save's ramp and cap, in 3 now.
    ``staging_slot_bytes``: the size of each device staging slot (a batch larger goes in parts).
    ``kernel_unroll``: 16-byte loads each thread of the copy kernels has in flight (one of
    ``kernels.block_copy.UNROLLS``).
    ``save_kernels``: saves (device to host) may pack, stage or copy with kernels as loads do.
    Off by default: a kernel in the daemon's CUDA context time-slices against the engine's step
    (vLLM's prefill step with saves 1.113x a step without them, against 1.025x with every save
    on the copy engines: ``benchmarks.vllm_store.step``, H200, 2026-11-29), and a save, unlike
    a load, is something no request waits for.
    ``batch_keeps_gil``: the ``cuMemcpyBatchAsync`` call holds the interpreter's lock instead of
    letting go of it, so a save or load does not wait to get it back behind the daemon's other
    threads once per chunk. Off by default: the gain measured within noise (README, s19), and
    the call can block (a full stream queue, pageable host memory, a driver lock another thread
    holds while it makes a device's context), which would stop the whole daemon meanwhile.
    ``wait_poll_us``: 0 (the default) waits for a batch's copies in ``cudaEventSynchronize``;
    N > 0 polls instead (``copy_handle.CopyHandle``): asleep until the batch's bytes could have
    crossed, then its event asked every N microseconds, blocking again once the batch is well
    overdue. On an H200 a 64-block load through the daemon went from 0.69 to 0.73 of raw
    (``transfer_daemon --variants default,wait_polled``, s38); on an H100 the same change was
    within noise, and the GPU test of a sticky CUDA error failed once with an unbounded poll
    (before the window), so it stays off until that test passes with it on a GPU.
    """

    small_runs: CopyMethod = CopyMethod.STAGED
    large_runs: CopyMethod = CopyMethod.BATCH
    packed_min_pieces: int = 2
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    load_growth: int = 4
    load_chunk_bytes: int = DEFAULT_LOAD_CHUNK_BYTES
    staging_slot_bytes: int = DEFAULT_STAGING_SLOT_BYTES
    kernel_unroll: int = UNROLL
    save_kernels: bool = False
    batch_keeps_gil: bool = False
    wait_poll_us: int = 0

    def __post_init__(self) -> None:
        for name in ("small_runs", "large_runs"):
            value = getattr(self, name)
            try:  # a method given by name becomes the enum member once, here
                object.__setattr__(self, name, CopyMethod(value))
            except ValueError:
                choices = ", ".join(m.value for m in CopyMethod)
                raise ValueError(f"{name} must be one of {choices}, got {value!r}") from None
        for name, least in (("packed_min_pieces", 1), ("chunk_bytes", 0), ("load_growth", 2),
                            ("load_chunk_bytes", 0), ("staging_slot_bytes", 1),
                            ("wait_poll_us", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
        for name in ("save_kernels", "batch_keeps_gil"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.kernel_unroll, bool) or self.kernel_unroll not in UNROLLS:
            raise ValueError(f"kernel_unroll must be one of {', '.join(map(str, UNROLLS))}, "
                             f"got {self.kernel_unroll!r}")
