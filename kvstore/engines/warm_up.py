"""Warm-up at registration: what a newly registered engine's first copies would build on the way.

Seen on two H200s (2026-11-28, the node benchmark): the first restore from the other engine's
arena ran cold (opening the source's IPC handle on the reading device, switching on peer access,
loading the copy kernel on that device), and the engine's restore policy took that first load
as its bandwidth for the HBM tier: every later restore from the peer was declined as slower
than recomputing (18k-token turns recomputed in 480-580 ms; with the warm-up they restored in
75-160). So the daemon loads the copy kernels on a device once, when its copier is made
(a copy of eight 16-byte runs on its copy stream), and when a CUDA engine registers it opens,
both ways, the mappings between its arena and every other registered arena on a device that
can reach it. A failure here is logged and costs only the warm-up: the copy path opens what it
needs itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kvstore.engines.cuda_ipc import can_access_peer
from kvstore.engines.registration import Registration

log = logging.getLogger(__name__)

_RUNS = 8  # enough runs that the copier takes its kernel, not a memcpy
_RUN_BYTES = 16


def warm_copier(copier) -> None:
    """Load ``copier``'s copy kernels on its device: one tiny device-to-device copy."""
    import cupy as cp

    from kvstore.engines.run_arrays import RunArrays

    with cp.cuda.Device(copier.device_id):
        scratch = cp.zeros(2 * _RUNS * _RUN_BYTES, dtype=cp.uint8)
        base = scratch.data.ptr
        src = base + cp.asnumpy(cp.arange(_RUNS, dtype=cp.int64)) * _RUN_BYTES
        runs = RunArrays(src, src + _RUNS * _RUN_BYTES,
                         cp.asnumpy(cp.full(_RUNS, _RUN_BYTES, dtype=cp.int64)), coalesced=True)
        copier.device_to_device(runs).wait()
        del scratch


def open_peer_mappings(new: Registration, others: Iterable[Registration]) -> int:
    """Open the mappings copies between ``new`` and each of ``others`` on another device will
    read through, both ways; how many were opened."""
    opened = 0
    for other in others:
        if other is new or not other.is_cuda or other.device_id == new.device_id:
            continue
        for reader, source in ((new, other), (other, new)):
            if not can_access_peer(reader.device_id, source.device_id):
                continue
            try:
                with source.open_for_copy():
                    source.device_ptrs([0], reader.device_id)
                opened += 1
            except Exception as exc:  # closed meanwhile, or the handle cannot be opened there
                log.warning("warm-up: engine %s's arena not opened on device %d: %s",
                            source.engine_id, reader.device_id, exc)
    return opened
