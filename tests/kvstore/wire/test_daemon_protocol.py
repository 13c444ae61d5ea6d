"""The control protocol in-process: framing, limits, envelopes, schemas, and a decoder fuzz."""

from __future__ import annotations

import contextlib
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.wire import protocol as proto

pytestmark = pytest.mark.timeout(120)

H16 = b"\x01" * 16


def frame(obj) -> bytes:
    return b"".join(proto.encode_frame(obj))


def lookup_request(**args) -> dict:
    base = {"namespace": H16, "hashes": [H16, H16], "idents": [b"a", b"b"]}
    return {"id": 7, "verb": "lookup", "args": {**base, **args}}


def test_frame_is_le_length_prefix_plus_msgpack() -> None:
    data = frame({"id": 1, "ok": True, "result": b"\x00\xff"})
    (length,) = struct.unpack("<I", data[:4])
    assert length == len(data) - 4
    assert msgpack.unpackb(data[4:], raw=False) == {"id": 1, "ok": True, "result": b"\x00\xff"}


def test_decoder_handles_any_chunking() -> None:
    messages = [{"id": i, "verb": "health", "args": {}} for i in range(5)]
    stream = b"".join(frame(m) for m in messages)
    for step in (1, 3, 7, len(stream)):
        dec = proto.FrameDecoder()
        out = []
        for i in range(0, len(stream), step):
            out += dec.feed(stream[i:i + step])
        assert out == messages
        assert dec.pending_bytes == 0


def test_oversized_length_prefix_rejected_before_body() -> None:
    dec = proto.FrameDecoder(max_frame_bytes=1024)
    with pytest.raises(proto.ProtocolError) as info:
        dec.feed(struct.pack("<I", 1025))  # no body at all: the header alone is refused
    assert info.value.code == proto.FRAME_TOO_LARGE
    with pytest.raises(proto.ProtocolError):
        proto.frame_length(struct.pack("<I", 2**32 - 1))
    assert proto.frame_length(struct.pack("<I", proto.MAX_FRAME_BYTES)) == proto.MAX_FRAME_BYTES


def test_encoding_a_too_large_frame_fails() -> None:
    with pytest.raises(proto.ProtocolError) as info:
        proto.encode_frame({"v": b"x" * 2048}, max_frame_bytes=1024)
    assert info.value.code == proto.FRAME_TOO_LARGE


@pytest.mark.parametrize("body", [
    b"\xc1",  # the one never-used msgpack byte
    b"\x92\x01",  # array of 2 with only 1 element
    msgpack.packb({"a": 1}) + b"\x00",  # trailing bytes
    msgpack.packb({1: "int key"}),  # strict_map_key
    msgpack.packb(msgpack.ExtType(5, b"boo")),  # ext types are not allowed
    msgpack.packb({"t": msgpack.Timestamp(1, 2)}),  # nor timestamps (ext -1)
    b"\x91" * 40 + b"\x01",  # 40 nested arrays: deeper than MAX_NESTING
])
def test_malformed_bodies(body: bytes) -> None:
    with pytest.raises(proto.ProtocolError) as info:
        proto.decode_body(body)
    assert info.value.code == proto.MALFORMED_FRAME


def test_no_pickle_anywhere() -> None:
    import pathlib

    import kvstore

    for path in pathlib.Path(kvstore.__file__).parent.rglob("*.py"):
        text = path.read_text()
        assert "import pickle" not in text and "pickle.loads" not in text, path


def test_request_envelope() -> None:
    req = proto.parse_request({"id": 3, "verb": "health", "deadline_ms": 250})
    assert (req.request_id, req.verb, req.deadline_ms, req.args) == (3, "health", 250, {})
    assert proto.parse_request({"id": 1, "verb": "stats", "args": {}}).deadline_ms == \
        proto.DEFAULT_DEADLINE_MS


@pytest.mark.parametrize(("obj", "code"), [
    ([1, 2], proto.MALFORMED_FRAME),
    ({"verb": "health"}, proto.MALFORMED_FRAME),
    ({"id": "1", "verb": "health"}, proto.MALFORMED_FRAME),
    ({"id": -1, "verb": "health"}, proto.MALFORMED_FRAME),
    ({"id": True, "verb": "health"}, proto.MALFORMED_FRAME),
    ({"id": 1, "verb": "frobnicate"}, proto.UNKNOWN_VERB),
    ({"id": 1, "verb": 5}, proto.BAD_REQUEST),
    ({"id": 1, "verb": "health", "deadline_ms": 0}, proto.BAD_REQUEST),
    ({"id": 1, "verb": "health", "deadline_ms": "soon"}, proto.BAD_REQUEST),
    ({"id": 1, "verb": "health", "args": [1]}, proto.BAD_REQUEST),
    ({"id": 1, "verb": "health", "extra": 1}, proto.BAD_REQUEST),
    ({"id": 1, "verb": "get", "args": {}}, proto.BAD_REQUEST),
    ({"id": 1, "verb": "get", "args": {"key": "str not bin"}}, proto.BAD_REQUEST),
    ({"id": 1, "verb": "put", "args": {"key": b"k", "value": 5}}, proto.BAD_REQUEST),
    ({"id": 1, "verb": "put", "args": {"key": b"k", "value": b"v", "zzz": 1}},
     proto.BAD_REQUEST),
    (lookup_request(hashes=[H16, b"short"]), proto.BAD_REQUEST),
    (lookup_request(hashes=[H16]), proto.BAD_REQUEST),  # idents differ in length
    (lookup_request(namespace=b"x" * 15), proto.BAD_REQUEST),
    (lookup_request(idents=[b"a", "b"]), proto.BAD_REQUEST),
    (lookup_request(lease_ttl_s="long"), proto.BAD_REQUEST),
    (lookup_request(lease_ttl_s=float("nan")), proto.BAD_REQUEST),
    ({"id": 1, "verb": "release", "args": {"lease_id": -3}}, proto.BAD_REQUEST),
    ({"id": 1, "verb": "save", "args": {"registration_id": 1, "namespace": H16,
                                        "block_ids": [0, -1], "hashes": [H16, H16],
                                        "idents": [b"", b""]}}, proto.BAD_REQUEST),
    ({"id": 1, "verb": "load", "args": {"registration_id": 1, "lease_id": 1,
                                        "block_ids": [0.5]}}, proto.BAD_REQUEST),
    ({"id": 1, "verb": "register", "args": {"layout": [], "engine_id": "e"}},
     proto.BAD_REQUEST),
])
def test_bad_requests(obj, code: str) -> None:
    with pytest.raises(proto.ProtocolError) as info:
        proto.parse_request(proto.decode_body(frame(obj)[4:], check_plain=False))
    assert info.value.code == code
    if code != proto.MALFORMED_FRAME:
        assert info.value.request_id == 1 or obj.get("id") == 7


def test_lookup_request_accepted() -> None:
    req = proto.parse_request(lookup_request(lease_ttl_s=2))
    assert req.args["hashes"] == [H16, H16]


def test_timestamp_inside_layout_is_refused() -> None:
    obj = {"id": 1, "verb": "register",
           "args": {"layout": {"meta": msgpack.Timestamp(0, 0)}, "engine_id": "e"}}
    body = msgpack.packb(obj, use_bin_type=True)
    with pytest.raises(proto.ProtocolError) as info:
        proto.parse_request(proto.decode_body(body, check_plain=False))
    assert info.value.code == proto.BAD_REQUEST


# -------------------------------------------------------------------------------- fuzzing

plain = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=600), chunk=st.integers(1, 64))
def test_fuzz_decoder_only_raises_protocol_errors(data: bytes, chunk: int) -> None:
    dec = proto.FrameDecoder(max_frame_bytes=4096)
    try:
        for i in range(0, len(data), chunk):
            for message in dec.feed(data[i:i + chunk]):
                with contextlib.suppress(proto.ProtocolError):
                    proto.parse_request(message)
    except proto.ProtocolError as exc:
        assert exc.code in (proto.MALFORMED_FRAME, proto.FRAME_TOO_LARGE)


@settings(max_examples=100, deadline=None)
@given(messages=st.lists(plain, max_size=4), chunk=st.integers(1, 50))
def test_fuzz_round_trip_any_chunking(messages: list, chunk: int) -> None:
    stream = b"".join(frame(m) for m in messages)
    dec = proto.FrameDecoder()
    out = []
    for i in range(0, len(stream), chunk):
        out += dec.feed(stream[i:i + chunk])
    assert out == messages


@settings(max_examples=150, deadline=None)
@given(verb=st.sampled_from(sorted(proto.SCHEMAS)),
       args=st.dictionaries(st.sampled_from(["namespace", "key", "value", "hashes", "idents",
                                             "lease_id", "block_ids", "registration_id",
                                             "layout", "engine_id", "lease_ttl_s", "x"]),
                            plain, max_size=6))
def test_fuzz_schema_validation_never_crashes(verb: str, args: dict) -> None:
    try:
        req = proto.parse_request({"id": 1, "verb": verb, "args": args})
    except proto.ProtocolError as exc:
        assert exc.code == proto.BAD_REQUEST
        return
    assert set(req.args) <= set(proto.SCHEMAS[verb])


@pytest.mark.parametrize("body", [
    b"\xc8\x00\x04\xff" + struct.pack(">I", 5),  # a timestamp in ext16: msgpack decodes it too
    b"\xc9\x00\x00\x00\x04\xff" + struct.pack(">I", 5),  # and in ext32
    msgpack.packb({"t": [msgpack.Timestamp(2**40, 5)]}),  # timestamp 96 (ext8)
    msgpack.packb({"t": msgpack.Timestamp(2**34 - 1, 5)}),  # timestamp 64 (fixext8)
    msgpack.packb([[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]),  # 33 deep
    msgpack.packb({"v": b"x" * 100_000, "t": msgpack.Timestamp(1, 0)}),  # beyond the quick check
])
def test_decode_refuses_timestamps_and_deep_nesting_whatever_the_encoding(body: bytes) -> None:
    with pytest.raises(proto.ProtocolError) as info:
        proto.decode_body(body)
    assert info.value.code == proto.MALFORMED_FRAME
    with pytest.raises(proto.ProtocolError):
        proto.decode_body(bytearray(body))
    with pytest.raises(proto.ProtocolError):
        proto.decode_body(memoryview(body))


def test_decode_accepts_plain_data_just_under_the_limits() -> None:
    deep = 1
    for _ in range(proto.MAX_NESTING - 2):  # the two maps at depths 0, 1; lists at 2..31
        deep = [deep]
    for d in (1, deep):
        reply = {"id": 255, "ok": True, "result": {"tiers": ["dram"] * 1024, "x": -1, "d": d}}
        body = msgpack.packb(reply, use_bin_type=True)
        assert proto.decode_body(body) == reply
        assert proto.decode_body(bytearray(body)) == reply
