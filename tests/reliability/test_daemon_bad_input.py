"""Bad save/load/register requests against a real daemon: typed errors, nothing touched.

A real `kvstore serve` maps two guarded shared-memory arenas (``guarded_arena``: guard bytes
before and after the registered blocks). Hypothesis sends save, load and register requests with
block ids out of range, negative or huge, of the wrong types, with other connections' leases and
registrations, and layouts that reach past the memory. Every reply is a result or a typed error
(never ``internal``), the connection stays usable, an error leaves the engine's memory exactly as
it was, a load writes only the blocks it reports, no guard byte ever changes, and the daemon lives.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from daemon_helpers import (
    RunningDaemon,
    make_chain,
    raw_connect,
    recv_message,
    send_message,
    start_daemon,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_helpers import GUARD_BYTES, guarded_arena
from support.arena import ShmArena

pytestmark = pytest.mark.timeout(180)

NUM_BLOCKS, BLOCK_BYTES, CHAIN_BLOCKS = 16, 16 * 1024, 8
U64 = 2**64 - 1
_SAVE_TAGS = iter(range(1, 1 << 30))
FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Conn:
    """One raw connection: requests with any field types msgpack can carry."""

    def __init__(self, daemon: RunningDaemon) -> None:
        self.sock: socket.socket = raw_connect(daemon.socket_path, timeout_s=30.0)
        self._ids = iter(range(1, 1 << 62))

    def call(self, verb: str, args: dict, fds: tuple[int, ...] = ()) -> dict:
        request_id = next(self._ids)
        send_message(self.sock, {"id": request_id, "verb": verb, "args": args}, fds)
        reply = recv_message(self.sock)
        assert reply is not None, f"the daemon closed the connection on {verb} {args!r:.200}"
        assert reply["id"] == request_id
        return reply

    def ok(self, verb: str, args: dict, fds: tuple[int, ...] = ()) -> dict:
        reply = self.call(verb, args, fds)
        assert reply["ok"], reply
        return reply["result"]


@dataclass
class Setup:
    daemon: RunningDaemon
    conn: Conn
    other: Conn  # a second client: its leases and registrations are not ours
    src: ShmArena
    dst: ShmArena
    spare: ShmArena  # the second client's own memory (a memory is registered once)
    reg_src: int
    reg_dst: int
    chain: object


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    daemon = start_daemon(tmp_path_factory.mktemp("bad-input"), dram="32MiB", http=False)
    src = guarded_arena(NUM_BLOCKS, BLOCK_BYTES, seed=1)
    dst = guarded_arena(NUM_BLOCKS, BLOCK_BYTES, seed=None)
    spare = guarded_arena(NUM_BLOCKS, BLOCK_BYTES, seed=None)
    try:
        conn, other = Conn(daemon), Conn(daemon)
        reg_src = conn.ok("register", {"layout": src.layout.to_wire(), "engine_id": "src"},
                          src.layout.fds)
        reg_dst = conn.ok("register", {"layout": dst.layout.to_wire(), "engine_id": "dst"},
                          dst.layout.fds)
        chain = make_chain("bad-input", CHAIN_BLOCKS, seed=4)
        saved = conn.ok("save", {"registration_id": reg_src["registration_id"],
                                 "namespace": chain.namespace,
                                 "block_ids": list(range(CHAIN_BLOCKS)),
                                 "hashes": chain.hashes, "idents": chain.idents})
        assert saved["num_saved"] == CHAIN_BLOCKS
        yield Setup(daemon, conn, other, src, dst, spare, reg_src["registration_id"],
                    reg_dst["registration_id"], chain)
        assert daemon.proc.poll() is None, "the daemon died"
        assert daemon.stop() == 0, "\n".join(daemon.lines)
    finally:
        if daemon.proc.poll() is None:
            daemon.stop()
        src.close()
        dst.close()
        spare.close()


def _typed(reply: dict, codes: set[str]) -> None:
    assert not reply["ok"], reply
    assert reply["error"]["code"] in codes, reply["error"]


_JUNK = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=4),
                  st.binary(max_size=4), st.just([]), st.just({}))
_IDS = st.one_of(st.integers(0, NUM_BLOCKS - 1), st.integers(NUM_BLOCKS, NUM_BLOCKS + 8),
                 st.integers(-(2**63), -1), st.integers(2**31, U64),
                 st.sampled_from([NUM_BLOCKS, -1, 2**32, 2**63, U64]), _JUNK)
_VALID_IDS = st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=CHAIN_BLOCKS)
# Half of the lists are valid, so that accepted requests are checked as closely as refused ones.
BLOCK_IDS = st.sampled_from([_VALID_IDS, _VALID_IDS, st.lists(_IDS, max_size=10), _JUNK]).flatmap(
    lambda strategy: strategy)


@FUZZ
@given(block_ids=BLOCK_IDS, lease_kind=st.sampled_from(["mine", "mine", "other", "bogus"]),
       reg_kind=st.sampled_from(["dst", "dst", "dst", "other", "bogus", "junk"]))
def test_fuzzed_loads_touch_only_the_blocks_they_report(setup: Setup, block_ids, lease_kind,
                                                        reg_kind) -> None:
    s = setup
    hit = s.conn.ok("lookup", {"namespace": s.chain.namespace, "hashes": s.chain.hashes,
                               "idents": s.chain.idents})
    assert hit["num_hit"] == CHAIN_BLOCKS
    other_hit = s.other.ok("lookup", {"namespace": s.chain.namespace,
                                      "hashes": s.chain.hashes[:1], "idents": s.chain.idents[:1]})
    lease_id = {"mine": hit["lease_id"], "other": other_hit["lease_id"],
                "bogus": 10**12}[lease_kind]
    other_reg = s.other.ok("register", {"layout": s.spare.layout.to_wire(), "engine_id": "x"},
                           s.spare.layout.fds)
    registration_id = {"dst": s.reg_dst, "other": other_reg["registration_id"], "bogus": 10**9,
                       "junk": "dst"}[reg_kind]
    before = s.dst.snapshot()
    reply = s.conn.call("load", {"registration_id": registration_id, "lease_id": lease_id,
                                 "block_ids": block_ids})
    if reply["ok"]:
        num_loaded = reply["result"]["num_loaded"]
        assert 0 <= num_loaded <= min(len(block_ids), CHAIN_BLOCKS)
        expected = bytearray(before)
        for index, block_id in enumerate(block_ids[:num_loaded]):
            start = GUARD_BYTES + block_id * BLOCK_BYTES
            expected[start:start + BLOCK_BYTES] = s.src.block(index)
        assert s.dst.snapshot() == bytes(expected), "a load wrote other bytes than it reported"
    else:
        _typed(reply, {"bad_request", "not_found"})
        assert s.dst.snapshot() == before, "a refused load touched the engine's memory"
    assert s.dst.guards_intact() and s.src.guards_intact()
    s.conn.call("release", {"lease_id": hit["lease_id"]})
    s.other.ok("release", {"lease_id": other_hit["lease_id"]})
    s.other.ok("unregister", {"registration_id": other_reg["registration_id"]})


@FUZZ
@given(block_ids=BLOCK_IDS, extra=st.integers(-1, 1), bad_hash=st.integers(0, 4),
       idents=st.one_of(st.none(), st.none(), st.lists(st.binary(max_size=40), max_size=10),
                        _JUNK),
       reg_kind=st.sampled_from(["src", "src", "src", "other", "bogus"]))
def test_fuzzed_saves_publish_only_whole_blocks(setup: Setup, block_ids, extra, bad_hash,
                                                idents, reg_kind) -> None:
    s = setup
    num_hashes = max(0, (len(block_ids) if isinstance(block_ids, list) else 2) + extra)
    tag = next(_SAVE_TAGS).to_bytes(4, "little")
    rng_hashes = [tag + bytes([n]) * 12 for n in range(num_hashes)]  # never seen before
    hashes: list = list(rng_hashes)
    if bad_hash == 0 and hashes:
        hashes[0] = hashes[0][:5]
    if idents is None:
        idents = [b"ident-%d" % n for n in range(num_hashes)]
    other_reg = s.other.ok("register", {"layout": s.spare.layout.to_wire(), "engine_id": "x"},
                           s.spare.layout.fds)
    registration_id = {"src": s.reg_src, "other": other_reg["registration_id"],
                       "bogus": 10**9}[reg_kind]
    before = s.src.snapshot()
    namespace = b"\x07" * 16
    reply = s.conn.call("save", {"registration_id": registration_id, "namespace": namespace,
                                 "block_ids": block_ids, "hashes": hashes, "idents": idents})
    assert s.src.snapshot() == before and s.src.guards_intact()  # a save only reads
    if reply["ok"]:
        outcomes = reply["result"]["outcomes"]
        assert len(outcomes) == len(block_ids) and set(outcomes) <= {"saved", "duplicate"}
        # Each saved block holds exactly the engine block it was saved from.
        for index, outcome in enumerate(outcomes):
            hit = s.conn.ok("lookup", {"namespace": namespace, "hashes": [hashes[index]],
                                       "idents": [idents[index]]})
            assert hit["num_hit"] == 1
            assert s.conn.ok("load", {"registration_id": s.reg_dst, "lease_id": hit["lease_id"],
                                      "block_ids": [0]})["num_loaded"] == 1
            assert s.dst.block(0) == s.src.block(block_ids[index]), outcome
        s.conn.ok("remove", {"namespace": namespace, "hashes": rng_hashes})
    else:
        _typed(reply, {"bad_request", "not_found"})
        if rng_hashes:  # nothing of a refused save was published
            hit = s.conn.ok("lookup", {"namespace": namespace, "hashes": rng_hashes,
                                       "idents": [b"ident-%d" % n for n in range(num_hashes)],
                                       "lease_ttl_s": 0})
            assert hit["num_hit"] == 0
    s.other.ok("unregister", {"registration_id": other_reg["registration_id"]})


_INTS = st.one_of(st.integers(-8, 8), st.integers(0, 4 * GUARD_BYTES + NUM_BLOCKS * BLOCK_BYTES),
                  st.integers(-(2**63), 2**63 - 1))
_SIZE = GUARD_BYTES + NUM_BLOCKS * BLOCK_BYTES  # the registered part of a guarded arena


def _near(*values: int) -> st.SearchStrategy[int]:
    """Values at and around the edges that matter, or any int."""
    return st.one_of(st.sampled_from(values).flatmap(lambda v: st.integers(v - 2, v + 2)),
                     st.sampled_from(values), _INTS)


@FUZZ
@given(num_blocks=st.one_of(_near(1, NUM_BLOCKS, NUM_BLOCKS + 1), _JUNK),
       size_bytes=_near(_SIZE, _SIZE + GUARD_BYTES, 2 * _SIZE),
       offset=_near(0, GUARD_BYTES, 2 * GUARD_BYTES),
       block_stride=_near(0, BLOCK_BYTES),
       block_bytes=st.one_of(_near(BLOCK_BYTES, 1), _JUNK),
       handle_kind=st.sampled_from(["own", "own", "own", "name", "index", "live"]))
def test_fuzzed_layouts_never_reach_past_the_memory(setup: Setup, num_blocks, size_bytes,
                                                   offset, block_stride, block_bytes,
                                                   handle_kind) -> None:
    s = setup
    # Its own memory's descriptor, a name (refused whatever it names), an index past the
    # frame's, or the descriptor of memory another connection has registered (refused).
    handle = {"own": 0, "name": "../dev/shm/kvengine", "index": 1, "live": 0}[handle_kind]
    layout = {"num_blocks": num_blocks, "device": "cpu", "dtype": "uint8", "meta": {},
              "regions": [{"handle": handle, "size_bytes": size_bytes, "offset": offset,
                           "block_stride": block_stride, "block_bytes": block_bytes}]}
    fds = s.src.layout.fds if handle_kind == "live" else s.spare.layout.fds
    reply = s.other.call("register", {"layout": layout, "engine_id": "fuzz"}, fds)
    assert handle_kind == "own" or not reply["ok"], reply
    if not reply["ok"]:
        _typed(reply, {"bad_request", "not_found", "permission_denied", "unsupported"})
        return
    # Accepted: then the sizes are integers and every block lies inside the shared memory.
    fields = (num_blocks, size_bytes, offset, block_stride, block_bytes)
    assert all(type(v) is int for v in fields), fields
    last_end = offset + (num_blocks - 1) * block_stride + block_bytes
    assert num_blocks > 0 and block_bytes > 0 and offset >= 0 and block_stride >= 0
    assert last_end <= size_bytes <= s.spare.size_bytes
    s.other.ok("unregister", {"registration_id": reply["result"]["registration_id"]})


@pytest.mark.parametrize("field", ["num_blocks", "size_bytes", "offset", "block_stride",
                                   "block_bytes"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 2.5, 16.0, True, "16", None, [16]])
def test_layout_sizes_of_the_wrong_type_are_refused(setup: Setup, field: str, value) -> None:
    layout = setup.spare.layout.to_wire()
    if field == "num_blocks":
        layout[field] = value
    else:
        layout["regions"] = [dict(layout["regions"][0], **{field: value})]
    reply = setup.other.call("register", {"layout": layout, "engine_id": "typed"},
                             setup.spare.layout.fds)
    _typed(reply, {"bad_request"})


def test_the_daemon_is_alive_and_whole_after_the_fuzz(setup: Setup) -> None:
    s = setup
    assert s.daemon.proc.poll() is None
    assert s.conn.ok("health", {})["status"] == "ok"
    with s.daemon.client() as c:
        stats = c.stats()
    assert stats["daemon"]["errors"].get("internal", 0) == 0
    assert stats["leases"] == stats["daemon"]["leases_active"] == 0
    assert stats["tiers"]["dram"]["pinned_blocks"] == 0
    assert stats["daemon"]["registrations"] == 2  # the two the fixture made, nothing else
    assert s.src.guards_intact() and s.dst.guards_intact() and s.spare.guards_intact()
