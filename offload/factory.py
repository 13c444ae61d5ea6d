"""Building the bridge for an engine: connect to the store (or keep trying), pick the priors."""

from __future__ import annotations

import logging

from offload.block_generations import BlockGenerations
from offload.bridge import StoreBridge
from offload.engine_store import EngineStore
from offload.engine_view import BlockLedger
from offload.offload_policy import OffloadPolicy
from offload.restore_policy import RestorePolicy
from offload.store_client import StoreClient
from offload.vocab import KVLayout

log = logging.getLogger("offload")

# Until measured: bytes/s per tier and prefill tokens/s, per device kind. Deliberately modest for
# the store so the first restores happen only where they clearly pay.
_PRIORS = {
    "cpu": ({"hbm": 4e9, "dram": 2e9, "ssd": 5e8, "remote": 2e8}, 2e3),
    "cuda": ({"hbm": 2e11, "dram": 2e10, "ssd": 1e9, "remote": 1e9}, 2e4),
}


def make_store_bridge(socket_path: str | None, layout: KVLayout, engine_id: str,
                      ledger: BlockLedger, block_bytes: int, policy: str,
                      device: str, always_restore: bool = False,
                      share_hbm: bool = True) -> StoreBridge:
    """Connect to the store (or keep retrying in the background) and build the bridge;
    ``policy`` is an ``OffloadPolicy`` value.

    ``share_hbm``: publish the cached blocks as the store's HBM tier (block generations in
    anonymous shared memory, sent by file descriptor with the registration)."""
    save_policy = OffloadPolicy(policy)  # a bad name fails before anything is made
    bandwidth, prefill = _PRIORS["cuda" if device.startswith("cuda") else "cpu"]
    generations = None
    if share_hbm:
        try:
            generations = BlockGenerations(layout.num_blocks)
        except OSError as exc:  # no memory or descriptors: serve, just without sharing the arena
            log.warning("kv offload: cannot create block generations in shared memory (%s); "
                        "this engine's blocks are not offered to other engines", exc)
    if generations is not None:
        layout = layout.with_generations(generations.fd)
    try:
        client = StoreClient(socket_path, layout, engine_id)
    except BaseException:
        if generations is not None:
            generations.close()
        raise
    return EngineStore(client, ledger, block_bytes, save_policy,
                       RestorePolicy(dict(bandwidth), prefill), always_restore, generations)
