"""A request with a chain of hundreds of thousands of blocks (inline verbs answer on the daemon's
event loop) is decoded and answered on a worker: the other clients' requests go on meanwhile."""

from __future__ import annotations

import threading
import time

import pytest
from daemon_helpers import RunningDaemon

from kvstore.keys import Namespace

pytestmark = pytest.mark.timeout(120)

NUM_BLOCKS = 1_000_000  # a 96 MB frame


def test_a_long_lookup_does_not_stall_the_other_clients(daemon: RunningDaemon) -> None:
    namespace = Namespace(name="long-chain").digest
    hashes = [i.to_bytes(16, "little") for i in range(NUM_BLOCKS)]
    idents = [b"\x01" * 80] * NUM_BLOCKS
    took: list[float] = []
    probes: list[float] = []

    def long_lookup() -> None:
        with daemon.client(timeout_s=60) as c:
            start = time.perf_counter()
            assert c.lookup(namespace, hashes, idents).num_hit == 0
            took.append(time.perf_counter() - start)

    with daemon.client() as prober:
        prober.health()
        worker = threading.Thread(target=long_lookup)
        worker.start()
        while worker.is_alive():
            start = time.perf_counter()
            prober.health()
            probes.append(time.perf_counter() - start)
            time.sleep(0.005)
        worker.join()
    assert took and len(probes) >= 5, (took, len(probes))
    # On the loop, the decode and the lookup held the probes for about half the lookup's time
    # (the rest is the client's encoding and the transfer); on a worker, for a few switch
    # intervals of the GIL.
    assert max(probes) < 0.25 * took[0], (max(probes), took[0])
