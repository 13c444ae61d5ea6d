"""Page-locked host memory for the DRAM pool: mapped, faulted in and registered by several threads.

A daemon restart is dead time for every engine it serves (they recompute until it answers), and
most of it went into one thread faulting the pool in (``MAP_POPULATE``) and then one
``cudaHostRegister`` call walking every page of each 64 GiB chunk: 44 s for 96 GiB on an H200
host. Here the mapping asks for transparent huge pages (512 times fewer faults where the host
offers them), ``fault_in`` splits the range among ``workers`` threads (``MADV_POPULATE_WRITE``
where the kernel has it, else a memset; both run in C without the GIL), and ``page_lock``
registers the chunks from as many threads. Every function raises on failure and leaves nothing
registered behind.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

PIN_CHUNK_BYTES = 64 << 30  # the most one cudaHostRegister call takes here
_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
# A worker's share is at least this much: below it a thread costs more than it saves.
_MIN_SHARE_BYTES = 1 << 30


class NoGpu(OSError):
    """CuPy or a CUDA device is missing: nothing to page-lock for."""


def default_workers() -> int:
    """Threads for faulting in and page-locking: the cores this process may use, at most 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(16, cores))


def map_anonymous(size: int) -> mmap.mmap:
    """A private anonymous mapping of ``size`` bytes, not yet faulted in, advised to use
    transparent huge pages (ignored where the host has none)."""
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            buffer.madvise(advice)
        except OSError as exc:  # THP compiled out or disabled: 4 KiB pages, only slower
            log.debug("madvise(MADV_HUGEPAGE) refused: %s", exc)
    return buffer


def shares(size: int, workers: int, unit: int) -> list[tuple[int, int]]:
    """``[offset, offset + length)`` pieces of ``size`` for up to ``workers`` threads, each a
    multiple of ``unit`` bytes (but the last) and at least ``_MIN_SHARE_BYTES`` where it can."""
    count = max(1, min(workers, size // _MIN_SHARE_BYTES))
    step = -(-size // count)
    step = -(-step // unit) * unit
    return [(off, min(step, size - off)) for off in range(0, size, step)]


def fault_in(address: int, size: int, workers: int) -> None:
    """Touch every page of ``[address, address + size)`` (writable, anonymous) from ``workers``
    threads, so no copy or O_DIRECT read pays for a fresh page later."""
    libc = _libc()
    pieces = shares(size, workers, mmap.PAGESIZE)

    def one(piece: tuple[int, int]) -> None:
        start, length = address + piece[0], piece[1]
        if libc is None or libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length),
                                        _MADV_POPULATE_WRITE) != 0:
            ctypes.memset(start, 0, length)  # an old kernel: write the zeros it already holds

    _run_all(one, pieces)


def page_lock(address: int, size: int, chunk_bytes: int, workers: int) -> list[int]:
    """``cudaHostRegister`` ``[address, address + size)`` in chunks of ``chunk_bytes`` from up to
    ``workers`` threads; returns the chunk addresses (for ``page_unlock``). ``NoGpu`` without
    CuPy or a device; on any failure the chunks already registered are unregistered."""
    try:
        import cupy
    except ImportError as exc:
        raise NoGpu("no CuPy") from exc
    try:
        num_devices = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver: CuPy raises instead of counting 0
        raise NoGpu(str(exc)) from None
    if num_devices <= 0:
        raise NoGpu("no CUDA device")
    flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
    starts = list(range(0, size, chunk_bytes))
    done: list[int] = []

    def one(start: int) -> None:
        cupy.cuda.runtime.hostRegister(address + start, min(chunk_bytes, size - start), flags)
        done.append(address + start)  # list.append is atomic

    try:
        _run_all(one, starts, workers)
    except BaseException:
        page_unlock(done)
        raise
    return sorted(done)


def page_unlock(chunks: list[int]) -> None:
    """Unregister what ``page_lock`` registered; failures are logged (at exit the runtime may
    already be gone)."""
    if not chunks:
        return
    import cupy

    for addr in chunks:
        try:
            cupy.cuda.runtime.hostUnregister(addr)
        except Exception as exc:
            log.warning("cudaHostUnregister(%#x) failed: %s", addr, exc)


def _run_all(fn, items: list, workers: int | None = None) -> None:
    """``fn(item)`` for every item, from up to ``workers`` threads (default: one per item);
    waits for all of them, then raises the first failure."""
    if len(items) == 1 or workers == 1:
        for item in items:
            fn(item)
        return
    with ThreadPoolExecutor(max_workers=min(len(items), workers or len(items)),
                            thread_name_prefix="kvstore-pool") as pool:
        futures = [pool.submit(fn, item) for item in items]
    for future in futures:
        future.result()


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc
