"""kvengine's saves: which blocks go to the store, and when, over the shared ``Saver``.

Write-through saves every newly computed full block after its step; ``evict`` saves a cached
block once its last user let go, so the engine never reuses (evicts) a block the store does not
hold yet. Blocks are pinned inside the step (before a finished sequence frees them); the saves
are sent after it, once the step's outputs are on their way. Keys the store acknowledged go to
``SavedKeys`` and are not saved again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from offload.core.save_job import SaveJob
from offload.core.saver import Saver
from offload.engine_view import OffloadSequence
from offload.idents import sequence_idents
from offload.ledger_site import LedgerSite
from offload.saved_keys import SavedKeys
from offload.store_client import StoreClient
from offload.vocab import ident_from_bytes

# Saves of at most this many blocks per request keep each round trip short.
SAVE_BATCH = 64


class EngineSaves:
    """Picks kvengine's blocks to save and remembers what the store holds (step thread)."""

    def __init__(self, client: StoreClient, site: LedgerSite, saved_keys: SavedKeys,
                 counters: Counter[str]) -> None:
        self.ledger = site.ledger
        self.block_size = site.block_size
        self.saved_keys = saved_keys
        self.saver = Saver(client, site, counters)

    def save_new_blocks(self, seq: OffloadSequence,
                        ready: Callable[[], bool] | None = None) -> None:
        """Write-through: pin the sequence's full blocks computed since its last save, sent
        once ``ready`` (the step's device work has finished writing them)."""
        num_full = min(seq.num_computed_tokens // self.block_size, seq.num_registered_blocks)
        start = seq.num_saved_blocks
        if num_full <= start:
            return
        js = [j for j in range(start, num_full) if seq.block_hashes[j] not in self.saved_keys]
        seq.num_saved_blocks = num_full
        # The ids are taken now: a sequence that finishes this step gives its blocks back.
        for i in range(0, len(js), SAVE_BATCH):
            chunk = js[i:i + SAVE_BATCH]
            self.saver.pin(seq.namespace_digest, [seq.block_ids[j] for j in chunk],
                           [seq.block_hashes[j] for j in chunk],
                           sequence_idents(seq, chunk, self.block_size), ready)

    def hand_over_released(self, ready: Callable[[], bool] | None = None) -> None:
        """``evict``: pin each cached block whose last user let go, to save it (sent once
        ``ready``: a block released mid-prompt may still be being written)."""
        by_namespace: dict[bytes, list[tuple[int, bytes, bytes]]] = {}
        for block_id, cached in self.ledger.drain_released():
            if cached.key in self.saved_keys:
                continue
            ident = ident_from_bytes(cached.parent_check, cached.token_bytes)
            by_namespace.setdefault(cached.namespace, []).append((block_id, cached.key, ident))
        for namespace, items in by_namespace.items():
            for i in range(0, len(items), SAVE_BATCH):
                ids, keys, idents = zip(*items[i:i + SAVE_BATCH])
                self.saver.pin(namespace, list(ids), list(keys), list(idents), ready)

    def send(self) -> None:
        """Send what the step pinned."""
        self.saver.send_pinned()

    def poll(self) -> None:
        """Remember the keys of saves that ended (their blocks are unpinned by the saver)."""
        self._remember(self.saver.poll())

    def wait_idle(self, timeout_s: float) -> None:
        """Send what is pinned, then wait (bounded) until the saves ended."""
        self._remember(self.saver.wait_idle(timeout_s))

    def _remember(self, ended: list[SaveJob]) -> None:
        for job in ended:
            self.saved_keys.add(job.stored_hashes)

    @property
    def num_in_flight(self) -> int:
        return len(self.saver.in_flight)
