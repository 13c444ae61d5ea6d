"""A copy verb's reply is written by its worker (``direct_reply.py``, ``reply_wire.py``): frames
stay whole beside the loop's replies on the same connection, and exactly one reply answers each
request, also when the deadline passes as the copy ends."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from daemon_helpers import make_chain, raw_connect, recv_message, send_message
from support.arena import ShmArena

from kvstore.wire.client import ClientError

pytestmark = pytest.mark.timeout(120)

NUM_BLOCKS = 32
BLOCK_BYTES = 64 * 1024


def _events(engine) -> dict:
    return engine.stats()["daemon"]["events"]


def test_copy_replies_come_from_their_workers_whole_beside_the_loops(make_daemon,
                                                                     arenas) -> None:
    daemon = make_daemon(dram="64MiB")
    arena = ShmArena(NUM_BLOCKS, BLOCK_BYTES, seed=5)
    arenas.append(arena)
    half = NUM_BLOCKS // 2
    stop, failures, loop_replies = threading.Event(), [], [0]
    with daemon.client(timeout_s=30.0) as engine:
        reg = engine.register(arena.layout, "engine")
        before = _events(engine)

        def loop_verbs() -> None:  # answered on the loop, on the same connection meanwhile
            try:
                while not stop.is_set():
                    assert engine.health()["status"] == "ok"
                    loop_replies[0] += 1
            except Exception as exc:  # noqa: BLE001 - reported by the test
                failures.append(exc)

        chatter = threading.Thread(target=loop_verbs)
        chatter.start()
        try:
            for round_ in range(20):
                chain = make_chain(f"direct-{round_}", half)
                saved = engine.save(reg, chain.namespace, list(range(half)), chain.hashes,
                                    chain.idents)
                assert saved.outcomes == ["saved"] * half
                hit = engine.lookup(chain.namespace, chain.hashes, chain.idents)
                assert hit.num_hit == half
                arena.blocks[half:] = 0
                assert engine.load(reg, hit.lease_id, list(range(half, NUM_BLOCKS))) == half
                np.testing.assert_array_equal(arena.blocks[half:], arena.blocks[:half])
        finally:
            stop.set()
            chatter.join(30)
        assert not failures and loop_replies[0] > 0
        after = _events(engine)
    by_worker = after["replies_by_worker"] - before.get("replies_by_worker", 0)
    declined = after["replies_by_worker_declined"] - before.get("replies_by_worker_declined", 0)
    assert by_worker + declined == 40  # every save and load: written by its worker, or left
    assert by_worker > 0  # to the loop when the transport had bytes to send


def test_a_copy_past_its_deadline_gets_one_reply(make_daemon, arenas) -> None:
    """The loop gives up at the deadline and answers; the worker, ending its copy, must not
    answer too (a second reply with the same id would be read as the next request's)."""
    daemon = make_daemon(dram="256MiB")
    num_blocks, block_bytes = 64, 1 << 20  # a 64 MiB save: many times the 1 ms deadline
    arena = ShmArena(num_blocks, block_bytes, seed=7)
    arenas.append(arena)
    chain = make_chain("deadline", num_blocks)
    sock = raw_connect(daemon.socket_path, timeout_s=30.0)
    try:
        send_message(sock, {"id": 1, "verb": "register", "deadline_ms": 10_000,
                            "args": {"layout": arena.layout.to_wire(), "engine_id": "e"}},
                     arena.layout.fds)
        reply = recv_message(sock)
        assert reply["ok"], reply
        reg = reply["result"]["registration_id"]
        codes = []
        for request_id in range(2, 12, 2):
            send_message(sock, {"id": request_id, "verb": "save", "deadline_ms": 1, "args": {
                "registration_id": reg, "namespace": chain.namespace,
                "block_ids": list(range(num_blocks)), "hashes": chain.hashes,
                "idents": chain.idents}})
            reply = recv_message(sock)
            assert reply["id"] == request_id
            codes.append("ok" if reply["ok"] else reply["error"]["code"])
            send_message(sock, {"id": request_id + 1, "verb": "health", "args": {}})
            follow = recv_message(sock)  # the save's worker wrote no second reply
            assert follow["id"] == request_id + 1 and follow["ok"], follow
        assert "deadline_exceeded" in codes, codes
    finally:
        sock.close()


def test_a_client_error_still_reaches_the_caller(make_daemon, arenas) -> None:
    """A copy verb that fails on its worker is answered by the loop, as before."""
    daemon = make_daemon(dram="16MiB")
    arena = ShmArena(4, BLOCK_BYTES, seed=9)
    arenas.append(arena)
    with daemon.client(timeout_s=10.0) as engine:
        reg = engine.register(arena.layout, "engine")
        with pytest.raises(ClientError, match="not_found|lease"):
            engine.load(reg, 12345, [0])
        assert engine.health()["status"] == "ok"


def test_a_reply_behind_unsent_bytes_goes_out_after_them(make_daemon, arenas) -> None:
    """While the transport still holds part of a large reply the client has not read, a copy
    verb's worker leaves its reply to the loop (counted as declined): it goes out whole, after
    the large one."""
    daemon = make_daemon(dram="64MiB")
    value = np.random.default_rng(3).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
    arena = ShmArena(4, BLOCK_BYTES, seed=11)
    arenas.append(arena)
    chain = make_chain("behind", 4)
    with daemon.client(timeout_s=10.0) as other:
        other.put(b"large", value)
        before = _events(other)["replies_by_worker_declined"]
        sock = raw_connect(daemon.socket_path, timeout_s=30.0)
        try:
            send_message(sock, {"id": 1, "verb": "register", "deadline_ms": 10_000,
                                "args": {"layout": arena.layout.to_wire(), "engine_id": "e"}},
                         arena.layout.fds)
            reg = recv_message(sock)["result"]["registration_id"]
            # 8 MiB the socket cannot take at once: the rest waits in the transport, unread
            send_message(sock, {"id": 2, "verb": "get", "deadline_ms": 10_000,
                                "args": {"namespace": "default", "key": b"large"}})
            deadline = time.monotonic() + 10
            while other.stats()["daemon"]["requests"].get("get", 0) < 1:
                assert time.monotonic() < deadline, "the get was not answered"
                time.sleep(0.01)
            send_message(sock, {"id": 3, "verb": "save", "deadline_ms": 10_000, "args": {
                "registration_id": reg, "namespace": chain.namespace, "block_ids": [0, 1, 2, 3],
                "hashes": chain.hashes, "idents": chain.idents}})
            deadline = time.monotonic() + 10
            while _events(other)["replies_by_worker_declined"] == before:
                assert time.monotonic() < deadline, "the save's reply was not left to the loop"
                time.sleep(0.01)
            first, second = recv_message(sock), recv_message(sock)
        finally:
            sock.close()
    assert first["id"] == 2 and first["result"]["value"] == value
    assert second["id"] == 3 and second["result"]["num_saved"] == 4
