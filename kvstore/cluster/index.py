"""The cluster's Redis index: node membership by TTL'd heartbeat, and which node holds which block.

Keys (``P`` is ``config.key_prefix``):

- ``P:n:<node_id>`` → ``"<incarnation> <host:port>"``, set with a TTL of ``node_ttl_s`` at every
  heartbeat; ``P:nodes`` is the set of node ids ever seen. A node that stops heartbeating drops out
  when its key expires; a clean stop deletes it.
- ``P:h:<namespace, 16 B>`` → a Redis hash ``block hash (16 B) → "node_id/incarnation ..."``.

Entries are hints. A lookup is one script call (one round trip) that returns the entries of the
longest run of claimed blocks as one string; only holders that are live with the same incarnation
in this node's membership view (refreshed at every heartbeat) count. Entries that look stale are
queued for deletion, which the write script re-checks against the node keys. Writes are queued by
``publish``/``unpublish`` (never a Redis call on the caller's thread; ``write_queue``) and sent by
one background thread, one script call per batch. When Redis is unreachable nothing raises into
callers: lookups answer "no holder", writes stay queued (bounded), and the thread retries with
exponential backoff. Once Redis answers again, a heartbeat that finds this node's key missing (Redis
restarted, or the key expired meanwhile) re-publishes every block this node holds.
"""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
from collections import Counter
from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.cluster.config import ClusterConfig
from kvstore.cluster.membership import Holder, Membership, parse_members
from kvstore.cluster.redis_scripts import DEREGISTER_LUA, LOOKUP_LUA, WRITE_LUA
from kvstore.cluster.write_queue import WriteQueue
from kvstore.keys import HASH_BYTES

log = logging.getLogger(__name__)

_KEY_BYTES = 2 * HASH_BYTES  # namespace + block hash

_REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


class ClusterIndex:
    """Membership and the block index of one node in Redis; ``start()`` before use."""

    def __init__(self, config: ClusterConfig, advertise_addr: str,
                 incarnation: str | None = None) -> None:
        self.config = config
        self.node_id = config.node_id
        self.incarnation = incarnation or secrets.token_hex(8)
        self.advertise_addr = advertise_addr
        prefix = config.key_prefix
        self._node_prefix = f"{prefix}:n:"
        self._nodes_key = f"{prefix}:nodes"
        self._node_key = f"{prefix}:n:{self.node_id}"
        self._node_value = f"{self.incarnation} {advertise_addr}".encode()
        self._entry = f"{self.node_id}/{self.incarnation}".encode()
        self._hash_prefix = f"{prefix}:h:".encode()
        self._redis = redis.Redis.from_url(
            config.redis_url, socket_timeout=config.redis_timeout_s,
            socket_connect_timeout=config.redis_timeout_s, retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False, health_check_interval=0,
        )
        self._write_script = self._redis.register_script(WRITE_LUA)
        self._lookup_script = self._redis.register_script(LOOKUP_LUA)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._counters: Counter[str] = Counter()
        self._queue = WriteQueue(self._entry, config.max_pending_events, self._counters)
        self._flush_now = False
        self._members = Membership(self.node_id)
        self._up = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._last_error = ""

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, timeout_s: float | None = None) -> bool:
        """Start the background thread; True once registered (waits at most ``timeout_s``).

        Redis being down is not an error here: the thread keeps retrying with backoff.
        """
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("ClusterIndex already started")
            self._thread = threading.Thread(target=self._run, name=f"kvstore-index-{self.node_id}",
                                            daemon=True)
            self._thread.start()
            wait_s = self.config.redis_timeout_s * 2 if timeout_s is None else timeout_s
            deadline = time.monotonic() + wait_s
            while not self._up and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            return self._up

    def stop(self, timeout_s: float = 2.0) -> None:
        """Flush queued writes (bounded), deregister and stop the thread. Idempotent."""
        if self._thread is not None and not self._stopping:
            self.flush(timeout_s / 2)
        with self._lock:
            self._stopping = True
            self._up = False
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("cluster index thread did not stop within %.1f s", timeout_s)
        try:  # peers drop this node now, not after the TTL (unless a newer life took the id)
            self._redis.eval(DEREGISTER_LUA, 1, self._node_key, self._node_value)
        except (redis.RedisError, OSError) as exc:
            log.info("could not deregister from Redis (%s); the heartbeat key will expire", exc)
        self._redis.close()

    # -- writes (queued) -----------------------------------------------------------------------

    def publish(self, namespace: bytes, block_hashes: Sequence[bytes]) -> None:
        """Queue "this node holds these blocks"; returns at once."""
        self._enqueue(namespace, block_hashes, True)

    def unpublish(self, namespace: bytes, block_hashes: Sequence[bytes]) -> None:
        """Queue "this node no longer holds these blocks"; returns at once."""
        self._enqueue(namespace, block_hashes, False)

    def _enqueue(self, namespace: bytes, block_hashes: Sequence[bytes], held: bool) -> None:
        _check_key(namespace, block_hashes)
        with self._lock:
            self._queue.advertise(namespace, block_hashes, held)
            self._cond.notify_all()

    def flush(self, timeout_s: float = 1.0) -> bool:
        """Send queued writes now; True when Redis acknowledged all of them within the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._flush_now = True
            self._cond.notify_all()
            while len(self._queue) or self._queue.in_flight:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None or self._stopping:
                    return False
                self._cond.wait(left)
            return True

    # -- reads ---------------------------------------------------------------------------------

    def lookup_holders(self, namespace: bytes, block_hashes: Sequence[bytes]) -> list[list[Holder]]:
        """Live holders (this node excluded) of each block, in one round trip; stops at the first
        block no other live node claims (the result is then shorter). Empty while Redis is away.
        """
        _check_key(namespace, block_hashes)
        if not block_hashes:
            return []
        if not self._up:
            self._count("lookups_index_down")
            return []
        out: list[list[Holder]] = []
        for start in range(0, len(block_hashes), _LOOKUP_CHUNK):
            chunk = block_hashes[start:start + _LOOKUP_CHUNK]
            try:
                raw = self._lookup_script(keys=[self._hash_prefix + namespace],
                                          args=[b"".join(chunk)], client=self._redis)
            except _REDIS_ERRORS as exc:
                self._count("lookup_errors")
                self._mark_down(f"lookup: {exc}")
                return []
            except redis.RedisError as exc:  # a script or server error: a miss, counted
                self._count("lookup_errors")
                log.warning("cluster index lookup failed: %s", exc)
                return []
            found, stale = self._members.parse(namespace, chunk, raw)
            if stale:
                self._forget(stale)
            out += found
            if len(found) < len(chunk):
                break
        self._count("lookups")
        return out

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _forget(self, stale: list[tuple[bytes, bytes]]) -> None:
        """Queue the deletion of entries that look like those of dead nodes or older
        incarnations; the write script deletes only those that really are."""
        with self._lock:
            self._queue.forget(stale)
            self._cond.notify_all()

    def lookup_prefix(self, namespace: bytes, block_hashes: Sequence[bytes]
                      ) -> list[tuple[str, str] | None]:
        """Per block, one live peer ``(node_id, addr)`` that claims it, or None; one round trip.

        Consecutive blocks prefer the same peer, so a prefix splits into few fetches.
        """
        out: list[tuple[str, str] | None] = []
        prev: Holder | None = None
        for candidates in self.lookup_holders(namespace, block_hashes):
            pick = prev if prev in candidates else candidates[0]
            out.append((pick.node_id, pick.addr))
            prev = pick
        return out + [None] * (len(block_hashes) - len(out))

    def live_nodes(self) -> dict[str, Holder]:
        """This node's view of the live nodes (itself included), as of the last heartbeat."""
        return self._members.live_nodes()

    @property
    def up(self) -> bool:
        return self._up

    def probe(self) -> str | None:
        """Ask Redis now (one PING, bounded by ``redis_timeout_s``), for the health probes: None
        when it answers, else why not; a failed PING marks the index down at once (the next
        successful heartbeat brings it back), rather than at the next heartbeat."""
        try:
            self._redis.ping()
        except (redis.RedisError, OSError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            self._mark_down(why)
            return why
        return None

    def stats(self) -> dict:
        with self._lock:
            return {"state": "up" if self._up else "down", "incarnation": self.incarnation,
                    "live_nodes": len(self._members),
                    "pending_events": len(self._queue) + self._queue.in_flight,
                    "published_blocks": len(self._queue.held), "last_error": self._last_error,
                    **self._counters}

    # -- background thread ---------------------------------------------------------------------

    def _mark_down(self, why: str) -> None:
        with self._lock:
            if self._up:
                log.warning("cluster index: Redis unreachable (%s); retrying with backoff", why)
                self._counters["redis_down_events"] += 1
            self._up = False
            self._last_error = why
            self._cond.notify_all()

    def _run(self) -> None:
        cfg = self.config
        next_heartbeat = 0.0
        backoff_s = cfg.backoff_initial_s
        while True:
            with self._lock:
                if self._stopping:
                    return
                now = time.monotonic()
                queued = len(self._queue)
                flush_due = queued and self._up and (
                    self._flush_now or queued >= cfg.flush_max_batch
                    or now - self._queue.since >= cfg.flush_interval_s)
                if not flush_due and now < next_heartbeat:
                    wake = next_heartbeat
                    if queued and self._up:
                        wake = min(wake, self._queue.since + cfg.flush_interval_s)
                    self._cond.wait(max(wake - now, 0.0))
                    continue
            try:
                if now >= next_heartbeat:
                    self._heartbeat()
                    next_heartbeat = time.monotonic() + cfg.heartbeat_interval_s
                    backoff_s = cfg.backoff_initial_s
                self._flush_pending()
            except (redis.RedisError, OSError) as exc:
                self._count("redis_errors")
                self._mark_down(f"{type(exc).__name__}: {exc}")
                next_heartbeat = time.monotonic() + backoff_s * random.uniform(0.5, 1.0)
                backoff_s = min(backoff_s * 2, cfg.backoff_max_s)

    def _heartbeat(self) -> None:
        """Refresh this node's key and read every live node, in one pipeline round trip."""
        ttl_ms = int(self.config.node_ttl_s * 1000)
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(self._node_key, self._node_value, px=ttl_ms, get=True)
        pipe.sadd(self._nodes_key, self.node_id)
        pipe.smembers(self._nodes_key)
        if not self._up:  # (re)connected: make sure the hot path never meets NOSCRIPT
            pipe.script_load(LOOKUP_LUA)
            pipe.script_load(WRITE_LUA)
        previous, _, node_ids, *_ = pipe.execute()
        node_ids = sorted(node_ids)
        values = self._redis.mget([self._node_prefix.encode() + n for n in node_ids])
        members = parse_members(node_ids, values)
        self._count("heartbeats")
        with self._lock:
            self._members.update(members)
            if previous is not None and previous != self._node_value:
                self._counters["node_id_conflicts"] += 1
                log.warning("cluster index: node id %s was registered by someone else (%r); "
                            "two daemons share a --node-id?", self.node_id, previous)
            if previous != self._node_value:
                # Redis lost our registration (first start, a restart, or the key expired while
                # we were away): publish all we hold again.
                if self._counters["heartbeats"] > 1:
                    self._counters["resyncs"] += 1
                    log.info("cluster index: registration was lost; re-publishing %d blocks",
                             len(self._queue.held))
                self._queue.resync()
            if not self._up:
                if self._counters["heartbeats"] > 1:
                    log.info("cluster index: Redis reachable again as node %s", self.node_id)
                self._up = True
                self._cond.notify_all()

    def _flush_pending(self) -> None:
        """Send the writes queued when it began, a script call per ``flush_max_batch`` (later
        ones wait: chasing a busy writer sent a small call per save on a loaded machine)."""
        with self._lock:
            left = len(self._queue)
        while True:
            with self._lock:
                if not len(self._queue) or left <= 0:
                    self._flush_now = self._flush_now and bool(len(self._queue))
                    self._cond.notify_all()
                    return
                batch = self._queue.take(min(self.config.flush_max_batch, left))
                left -= len(batch)
            try:
                self._write_script(
                    keys=[], client=self._redis,
                    args=[self._hash_prefix, self._node_prefix, b"".join(key for key, _ in batch),
                          b"".join(op for _, (op, _) in batch),
                          *(entry for _, (_, entry) in batch)])
            except BaseException:
                with self._lock:
                    self._queue.requeue(batch)
                raise
            with self._lock:
                self._queue.acknowledge(batch)
                self._cond.notify_all()


_LOOKUP_CHUNK = 4096  # hashes per lookup script call (Lua's unpack limit is near 8000)


def _check_key(namespace: bytes, block_hashes: Sequence[bytes]) -> None:
    if len(namespace) != HASH_BYTES or any(len(h) != HASH_BYTES for h in block_hashes):
        raise ValueError(f"namespace and block hashes must be {HASH_BYTES} bytes each")
