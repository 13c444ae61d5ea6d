"""OffloadPolicy: when kvengine saves a block to the store (``--kv-offload-policy``).

Apart from ``engine_store`` so that the engine's config and the server's flags name the policies
without loading the store bridge."""

from __future__ import annotations

import enum


class OffloadPolicy(str, enum.Enum):
    """When kvengine saves a block (``--kv-offload-policy``)."""

    WRITE_THROUGH = "write-through"  # after the step that computed it
    EVICT = "evict"  # when the engine lets go of it (not reused until the store holds it)

    def __str__(self) -> str:
        return self.value
