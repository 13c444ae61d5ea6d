"""Publishing the arena to the store: evicted blocks, and (HBM tier) blocks resident now.

After each step the blocks newly registered in the prefix cache are published as resident (block
id, hash, ident, generation), after the step's evictions, so another engine on the same daemon can
get them by a copy between the arenas; a new registration (a reconnect) republishes every cached
block. Every eviction is published.
"""

from __future__ import annotations

from collections import Counter

from offload.engine_view import BlockLedger, Generations
from offload.store_client import StoreClient
from offload.vocab import ident_from_bytes

# Resident publications are index updates only: larger batches than saves.
RESIDENT_BATCH = 1024


class ResidentPublisher:
    """Tells the store what this engine's arena holds (step thread only)."""

    def __init__(self, client: StoreClient, ledger: BlockLedger,
                 generations: Generations | None, counters: Counter[str]) -> None:
        self.client = client
        self.ledger = ledger
        self.generations = generations
        self.counters = counters
        self._published_epoch = -1  # the registration the resident blocks were published to

    def publish(self) -> None:
        """Evictions first, then resident blocks (the daemon keeps the order)."""
        self.publish_evictions()
        if self.generations is not None:
            self._publish_resident(self.generations)

    def publish_evictions(self) -> None:
        """Only the evictions: the blocks registered since may not be written yet."""
        for namespace, keys in self.ledger.drain_evicted_keys().items():
            self.client.evicted(namespace, keys)
            self.counters["evictions_published"] += len(keys)

    def _publish_resident(self, generations: Generations) -> None:
        items = self.ledger.drain_resident()
        if self._published_epoch != self.client.registration_epoch:
            if not self.client.available:
                return  # republished in full once connected again
            items = self.ledger.cached_items()
            self._published_epoch = self.client.registration_epoch
        if not items:
            return
        by_namespace: dict[bytes, list[tuple[int, bytes, bytes, int]]] = {}
        gen = generations.get
        for block_id, cached in items:
            ident = ident_from_bytes(cached.parent_check, cached.token_bytes)
            by_namespace.setdefault(cached.namespace, []).append(
                (block_id, cached.key, ident, gen(block_id)))
        for namespace, rows in by_namespace.items():
            for i in range(0, len(rows), RESIDENT_BATCH):
                ids, keys, idents, gens = zip(*rows[i:i + RESIDENT_BATCH])
                self.client.resident(namespace, ids, keys, idents, gens)
        self.counters["resident_published"] += len(items)
