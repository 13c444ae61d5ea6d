"""Block data, fast timings and small helpers shared by the cluster tests and their node process."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import numpy as np

from kvstore.keys import Namespace, block_hashes, block_ident

# Short timings so failure paths finish in well under a second each.
FAST = {"heartbeat_interval_s": 0.1, "node_ttl_s": 0.5, "redis_timeout_s": 0.2,
        "remote_timeout_s": 1.0, "backoff_initial_s": 0.05, "backoff_max_s": 0.2,
        "flush_interval_s": 0.002}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float, interval_s: float = 0.02) -> bool:
    """Poll ``predicate`` until true or ``timeout_s`` passed; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


@dataclass
class Blocks:
    """A chain of KV-like blocks: hashes, idents and random payloads."""

    namespace: bytes
    hashes: list[bytes]
    idents: list[bytes]
    payloads: list[bytes]

    def put_all(self, store, node=None, count: int | None = None) -> None:
        """Store the first ``count`` blocks; with ``node``, publish them and wait for Redis."""
        n = len(self.hashes) if count is None else count
        for h, ident, data in zip(self.hashes[:n], self.idents[:n], self.payloads[:n]):
            store.put(self.namespace, h, ident, data)
        if node is not None:
            node.on_stored(self.namespace, self.hashes[:n])
            assert node.index.flush(2.0)


def make_blocks(num_blocks: int, block_bytes: int = 64 << 10, seed: int = 0) -> Blocks:
    rng = np.random.default_rng(seed)
    ns = Namespace(tenant_salt="t", name=f"test-{seed}").digest
    tokens = rng.integers(0, 50_000, size=num_blocks * 16)
    hashes = block_hashes(ns, tokens, 16)
    parents = [ns, *hashes[:-1]]
    idents = [block_ident(parents[i], tokens[i * 16:(i + 1) * 16]) for i in range(num_blocks)]
    payloads = [rng.bytes(block_bytes) for _ in range(num_blocks)]
    return Blocks(ns, hashes, idents, payloads)
