"""The packed form of `lookup`: two bins instead of 2N items, tier runs instead of N strings."""

from __future__ import annotations

import pytest
from daemon_helpers import RunningDaemon, make_chain, raw_connect, recv_message, send_message
from support.arena import ShmArena

from kvstore.store.block_store import Tier
from kvstore.wire import protocol as proto
from kvstore.wire.client import Client, ClientError

pytestmark = pytest.mark.timeout(90)

H16 = b"\x01" * 16
BLOCK_BYTES = 4096


def packed_request(**args) -> dict:
    base = {"namespace": H16, "hashes_packed": H16 * 2, "idents_packed": b"ab", "ident_len": 1}
    return {"id": 9, "verb": "lookup", "args": {**base, **args}}


def without(obj: dict, *names: str) -> dict:
    return {**obj, "args": {k: v for k, v in obj["args"].items() if k not in names}}


def test_packed_request_accepted_and_split() -> None:
    req = proto.parse_request(packed_request(lease_ttl_s=1))
    hashes, idents, packed = proto.lookup_items(req.args)
    assert packed and hashes == [H16, H16] and idents == [b"a", b"b"]
    # Trailing zero bytes survive the split (a "16s" field never strips them).
    req = proto.parse_request(packed_request(hashes_packed=bytes(32), idents_packed=b"\0\0",
                                             ident_len=1))
    assert proto.lookup_items(req.args)[:2] == ([bytes(16)] * 2, [b"\0", b"\0"])
    empty = proto.parse_request(packed_request(hashes_packed=b"", idents_packed=b""))
    assert proto.lookup_items(empty.args) == ([], [], True)


@pytest.mark.parametrize("obj, needle", [
    (packed_request(hashes_packed=H16 + b"x"), "not a multiple of 16"),
    (packed_request(idents_packed=b"abc", ident_len=2), "not a multiple of ident_len"),
    (packed_request(idents_packed=b"abc"), "2 hashes but 3 idents"),
    (packed_request(hashes_packed=H16 * 3), "3 hashes but 2 idents"),
    (packed_request(ident_len=0, idents_packed=b""), "ident_len must be in"),
    (packed_request(ident_len=-1), "ident_len must be in"),
    (packed_request(ident_len=proto.MAX_IDENT_LEN + 1), "ident_len must be in"),
    (packed_request(ident_len=True), "'ident_len' must be int"),
    (packed_request(ident_len=1.0), "'ident_len' must be int"),
    (packed_request(hashes_packed=[H16, H16]), "'hashes_packed' must be bin"),
    (packed_request(idents_packed="ab"), "'idents_packed' must be bin"),
    (packed_request(hashes=[H16, H16], idents=[b"a", b"b"]), "not both"),
    (packed_request(hashes=[H16, H16]), "not both"),
    (without(packed_request(), "ident_len"), "packed form is missing ['ident_len']"),
    (without(packed_request(), "hashes_packed"), "packed form is missing ['hashes_packed']"),
    (without(packed_request(), "hashes_packed", "idents_packed", "ident_len"),
     "missing arg 'hashes'"),
    (without(packed_request(hashes=[H16]), "hashes_packed", "idents_packed", "ident_len"),
     "missing arg 'idents'"),
])
def test_bad_packed_requests(obj: dict, needle: str) -> None:
    with pytest.raises(proto.ProtocolError) as info:
        proto.parse_request(obj)
    assert info.value.code == proto.BAD_REQUEST and info.value.request_id == 9
    assert needle in str(info.value), str(info.value)


def test_pack_lookup_only_when_every_ident_fits() -> None:
    assert proto.pack_lookup([H16, H16], [b"ab", b"cd"]) == {
        "hashes_packed": H16 * 2, "idents_packed": b"abcd", "ident_len": 2}
    assert proto.pack_lookup([H16, H16], [b"a", b"bc"]) is None  # unequal lengths
    assert proto.pack_lookup([H16, H16], [b"abc", b"d"]) is None  # same total, unequal
    assert proto.pack_lookup([H16], [b""]) is None  # ident_len 0 is not a packed length
    assert proto.pack_lookup([], []) is None
    assert proto.pack_lookup([H16[:15], H16 + b"x"], [b"a", b"b"]) is None  # bad hash sizes
    assert proto.pack_lookup([H16], [b"a", b"b"]) is None  # count mismatch
    assert proto.pack_lookup([H16], ["a"]) is None  # not bytes: the list form reports it


@pytest.mark.parametrize("tiers", [
    [], [Tier.DRAM] * 5, [Tier.DRAM, Tier.DRAM, Tier.SSD, Tier.DRAM, Tier.REMOTE, Tier.REMOTE],
    ["ssd"], ["dram", "ssd"],
])
def test_tier_runs_round_trip(tiers: list) -> None:
    runs = proto.tier_runs(tiers)
    assert all(type(t) is str and n > 0 for t, n in runs)
    assert proto.expand_tier_runs(runs) == [getattr(t, "value", t) for t in tiers]
    assert len(runs) == len([i for i in range(len(tiers)) if i == 0 or tiers[i] != tiers[i - 1]])


def _save_chain(client: Client, name: str, num_blocks: int):
    chain = make_chain(name, num_blocks)
    arena = ShmArena(num_blocks, BLOCK_BYTES)
    reg = client.register(arena.layout, f"packed-{name}")
    assert client.save(reg, chain.namespace, range(num_blocks), chain.hashes,
                       chain.idents).num_saved == num_blocks
    assert client.unregister(reg)
    return chain, arena


def _list_lookup(client: Client, namespace: bytes, hashes: list, idents: list, ttl=None):
    args = {"namespace": namespace, "hashes": hashes, "idents": idents}
    if ttl is not None:
        args["lease_ttl_s"] = ttl
    return client.request("lookup", args).wait()


def test_packed_and_list_forms_agree_through_the_daemon(daemon: RunningDaemon) -> None:
    with daemon.client() as c:
        chain, arena = _save_chain(c, "packed-agree", 64)
        try:
            assert len({len(i) for i in chain.idents}) == 1  # the engine's case: packed
            for num_hit, hashes in [
                (64, chain.hashes),
                (20, chain.hashes[:20] + [bytes(16)] + chain.hashes[21:]),
                (0, [bytes(16)] + chain.hashes[1:]),
                (0, []),
            ]:
                idents = chain.idents[:len(hashes)]
                raw = _list_lookup(c, chain.namespace, hashes, idents, ttl=0)
                assert raw["num_hit"] == num_hit and "tier_runs" not in raw
                packed = c.lookup(chain.namespace, hashes, idents, lease_ttl_s=0)
                assert packed.num_hit == num_hit and packed.lease_id is None
                assert packed.tiers == raw["tiers"] == ["dram"] * num_hit
            leased = c.lookup(chain.namespace, chain.hashes, chain.idents)
            assert leased.lease_id is not None and c.release(leased.lease_id)
            # A wrong ident is a miss in both forms.
            bad_idents = [b"\xff" * len(chain.idents[0])] + chain.idents[1:]
            assert c.lookup(chain.namespace, chain.hashes, bad_idents, 0).num_hit == 0
        finally:
            arena.close()


def test_packed_request_gets_runs_on_the_wire(daemon: RunningDaemon) -> None:
    with daemon.client() as c:
        chain, arena = _save_chain(c, "packed-wire", 16)
    try:
        sock = raw_connect(daemon.socket_path)
        args = {"namespace": chain.namespace, "lease_ttl_s": 0,
                **proto.pack_lookup(chain.hashes, chain.idents)}
        send_message(sock, {"id": 1, "verb": "lookup", "args": args})
        reply = recv_message(sock)
        assert reply["ok"], reply
        assert reply["result"] == {"num_hit": 16, "tier_runs": [["dram", 16]], "lease_id": None}
        send_message(sock, {"id": 2, "verb": "lookup",
                            "args": {**args, "idents_packed": args["idents_packed"][:-1]}})
        reply = recv_message(sock)
        assert not reply["ok"] and reply["error"]["code"] == proto.BAD_REQUEST
        assert "not a multiple of ident_len" in reply["error"]["message"]
        sock.close()
    finally:
        arena.close()


def test_client_falls_back_to_lists_for_unequal_idents(daemon: RunningDaemon) -> None:
    with daemon.client() as c:
        reply = c.lookup(H16, [H16, H16], [b"a", b"bc"], lease_ttl_s=0)
        assert reply.num_hit == 0 and reply.tiers == []
        with pytest.raises(ClientError) as info:  # bad hashes still fail, in the list form
            c.lookup(H16, [H16, b"short"], [b"a", b"b"])
        assert info.value.code == proto.BAD_REQUEST
