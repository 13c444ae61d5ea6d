"""A cluster node in its own process, for the tests that kill one: prints its address, then
serves until stdin closes or it is killed.

    python tests/kvstore/cluster/node_process.py REDIS_URL NODE_ID NUM_BLOCKS SEED
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
# daemon_helpers (which cluster_parts imports) lives in tests/; the repository goes first, so
# `kvstore` is the package, not the tests' folder of that name.
sys.path[1:1] = [str(Path(__file__).parents[3]), str(Path(__file__).parents[2])]

from cluster_parts import FAST, make_blocks  # noqa: E402

from kvstore.cluster.config import ClusterConfig  # noqa: E402
from kvstore.cluster.node import ClusterNode  # noqa: E402
from kvstore.store.tiered import StoreConfig, TieredStore  # noqa: E402


def main() -> None:
    redis_url, node_id, num_blocks, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(
        sys.argv[4])
    store = TieredStore(StoreConfig(dram_bytes=64 << 20))
    node = ClusterNode(ClusterConfig(redis_url=redis_url, node_id=node_id, **FAST), store)
    node.start()
    make_blocks(num_blocks, seed=seed).put_all(store, node)
    print(json.dumps({"addr": node.addr, "incarnation": node.incarnation}), flush=True)
    sys.stdin.read()
    node.stop()
    store.close()


if __name__ == "__main__":
    main()
