"""One daemon's part in the cluster: the Redis index, the UCX peer server and the peer client.

The daemon owns one ``ClusterNode`` (only with ``--cluster``) and calls it at three points:

- after blocks are stored locally (``save``/``put`` committed): ``on_stored(namespace, hashes)``;
- when blocks leave this node entirely (not a DRAM → SSD demotion): ``on_evicted(...)``;
- after a local lookup hit ``n`` of ``len(hashes)`` blocks: ``fetch_remote_prefix(namespace,
  hashes, idents, start_index=n)`` pulls the longest run of the rest from live peers into the
  local store and returns how many arrived; the daemon then serves them like local blocks (tier
  "remote"). Both hooks only queue work; the fetch is bounded by ``remote_timeout_s``.

Which UCX transports reach each peer (tcp, shared memory, cuda_ipc, RDMA: UCX's choice) is logged
at INFO once per peer and whenever it changes, and shown in ``stats()["peers"]``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence

from kvstore.cluster.config import ClusterConfig
from kvstore.cluster.index import ClusterIndex
from kvstore.cluster.membership import Holder
from kvstore.cluster.peers.client import PeerClient
from kvstore.cluster.peers.server import PeerServer
from kvstore.cluster.ucx.transports import data_transports
from kvstore.store.block_store import BlockStore

log = logging.getLogger(__name__)

# Fetch failures after which a peer is skipped for ``suspect_s``: it is down, slow or lies.
_SUSPECT_ERRORS = frozenset({"unreachable", "timeout", "transport", "protocol", "bad_block"})


class ClusterNode:
    """Cross-node sharing for one local store; ``start()`` it, ``stop()`` it."""

    def __init__(self, config: ClusterConfig, store: BlockStore,
                 incarnation: str | None = None) -> None:
        self.config = config
        self.store = store
        self._incarnation = incarnation
        self.server = PeerServer(store, config.listen_host, config.listen_port,
                                 config.max_blocks_per_fetch)
        self.client = PeerClient(config.endpoints_per_peer, config.max_block_bytes)
        self.index: ClusterIndex | None = None
        self.addr = ""
        self._suspects: dict[tuple[str, str], float] = {}
        self._peer_ids: dict[str, str] = {}  # address → node id, of the peers fetched from
        self._logged_lanes: dict[str, list[str] | None] = {}  # per address, as last logged
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()

    @property
    def incarnation(self) -> str:
        return self.index.incarnation if self.index is not None else ""

    def start(self, register_timeout_s: float | None = None) -> bool:
        """Listen for peers, register in Redis; True once registered (Redis down is no error:
        the node joins when Redis answers)."""
        port = self.server.start()
        try:
            self.addr = self.config.advertise_addr(port)
            self.client.start()
            self.index = ClusterIndex(self.config, self.addr, self._incarnation)
            registered = self.index.start(register_timeout_s)
        except BaseException:
            self.stop()
            raise
        log.info("cluster node %s (incarnation %s) serving on %s; registered: %s",
                 self.config.node_id, self.incarnation, self.addr, registered)
        return registered

    def stop(self) -> None:
        """Deregister, stop serving peers, drop cached endpoints. Idempotent."""
        if self.index is not None:
            self.index.stop()
        self.server.stop()
        self.client.close()

    # -- hooks ---------------------------------------------------------------------------------

    def on_stored(self, namespace: bytes, block_hashes: Sequence[bytes]) -> None:
        """The local store now holds these blocks: advertise them (queued, returns at once)."""
        if self.index is not None and block_hashes:
            self.index.publish(namespace, block_hashes)

    def on_evicted(self, namespace: bytes, block_hashes: Sequence[bytes]) -> None:
        """These blocks left this node (every tier): withdraw them (queued, returns at once)."""
        if self.index is not None and block_hashes:
            self.index.unpublish(namespace, block_hashes)

    # -- remote reads --------------------------------------------------------------------------

    def has_peers(self) -> bool:
        """Whether Redis answers and another live node is in view (as of the last heartbeat).
        Cheap, no IO: without a peer a fetch cannot find anything, so the daemon does not try."""
        index = self.index
        return index is not None and index.up and any(
            holder.node_id != self.config.node_id for holder in index.live_nodes().values())

    def fetch_remote_prefix(self, namespace: bytes, block_hashes: Sequence[bytes],
                            idents: Sequence[bytes], start_index: int = 0) -> int:
        """Fetch blocks ``start_index, start_index + 1, ...`` from live peers into the local
        store, stopping at the first one no peer delivers; returns how many arrived. Never
        raises for Redis or peer trouble, and returns by ``remote_timeout_s``.
        """
        if len(block_hashes) != len(idents):
            raise ValueError("block_hashes and idents differ in length")
        hashes = list(block_hashes[start_index:])
        wanted = list(idents[start_index:])
        if self.index is None or not hashes:
            return 0
        deadline = time.monotonic() + self.config.remote_timeout_s
        holders = self.index.lookup_holders(namespace, hashes)
        if not holders:
            self._count("remote_misses")
            return 0
        num_done = 0
        errors: list[str] = []
        tried: set[Holder] = set()
        asked = False
        while num_done < len(holders) and time.monotonic() < deadline:
            peer, run_len = self._pick(holders, num_done, tried)
            if peer is None:
                break
            asked = True
            end = num_done + run_len
            num_stored, error = self.client.fetch_into(
                self.store, peer.addr, namespace, hashes[num_done:end], wanted[num_done:end],
                deadline)
            self._note_peer(peer)
            if num_stored:
                self.index.publish(namespace, hashes[num_done:num_done + num_stored])
            num_done += num_stored
            if error == "store_full":
                self._count("remote_store_refused")  # no room here: not the peer's fault
                break
            if error is not None:
                errors.append(error)
                self._count(f"remote_errors_{error}")
                if error in _SUSPECT_ERRORS:
                    self._suspect(peer)
            if num_stored < run_len:
                tried.add(peer)  # this peer has no more of the run: ask another holder
        if num_done:
            self._count("remote_hits")
            self._count("remote_hit_blocks", num_done)
        elif errors:
            self._count("remote_errors")
        elif asked:
            self._count("remote_stale")  # claimed in the index, but no peer had it any more
        else:
            self._count("remote_misses")  # every holder is suspect (or the deadline passed)
        return num_done

    def _pick(self, holders: list[list[Holder]], pos: int,
              tried: set[Holder]) -> tuple[Holder | None, int]:
        """The usable holder of block ``pos`` with the longest run from there, and that run."""
        now = time.monotonic()
        best, best_len = None, 0
        for peer in holders[pos]:
            if peer in tried or self._is_suspect(peer, now):
                continue
            run_len = 1
            while pos + run_len < len(holders) and peer in holders[pos + run_len]:
                run_len += 1
            if run_len > best_len:
                best, best_len = peer, run_len
        if best is None:
            self._count("remote_skipped_suspect")
        return best, min(best_len, self.config.max_blocks_per_fetch)

    def _note_peer(self, peer: Holder) -> None:
        """Remember whose address this is; log the UCX lanes to it when new or changed."""
        lanes = self.client.lanes()
        if peer.addr not in lanes:
            return  # no endpoint was made (the peer did not answer)
        found = lanes[peer.addr]
        with self._lock:
            self._peer_ids[peer.addr] = peer.node_id
            if peer.addr in self._logged_lanes and self._logged_lanes[peer.addr] == found:
                return
            self._logged_lanes[peer.addr] = found
        log.info("UCX to peer %s (%s): %s (lanes: %s)", peer.node_id, peer.addr,
                 ", ".join(data_transports(found)) or "unknown",
                 ", ".join(found) if found else "ucp_ep_query unavailable")

    def peers(self) -> dict[str, dict]:
        """Per peer node fetched from: its address and the UCX transports to it ("unknown"
        where UCX could not tell)."""
        lanes = self.client.lanes()
        with self._lock:
            ids = dict(self._peer_ids)
        return {node_id: {"addr": addr, "transports": data_transports(lanes.get(addr)) or
                          ["unknown"], "lanes": lanes.get(addr) or []}
                for addr, node_id in sorted(ids.items())}

    def _suspect(self, peer: Holder) -> None:
        with self._lock:
            self._suspects[(peer.node_id, peer.incarnation)] = (
                time.monotonic() + (self.config.suspect_s or 0.0))

    def _is_suspect(self, peer: Holder, now: float) -> bool:
        with self._lock:
            until = self._suspects.get((peer.node_id, peer.incarnation))
            if until is None:
                return False
            if until <= now:
                del self._suspects[(peer.node_id, peer.incarnation)]
                return False
            return True

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def stats(self) -> dict:
        """Counters of this node: remote outcomes, the index, the peer server and client."""
        with self._lock:
            out: dict = {"node_id": self.config.node_id, "incarnation": self.incarnation,
                         "addr": self.addr, "suspect_peers": len(self._suspects),
                         **self._counters}
        out["index"] = self.index.stats() if self.index is not None else {"state": "stopped"}
        out["server"] = self.server.stats()
        out["client"] = self.client.stats()
        out["peers"] = self.peers()
        return out
