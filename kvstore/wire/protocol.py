"""The control protocol: length-prefixed msgpack frames, request/reply envelopes, per-verb schemas.

A frame is a 4-byte little-endian body length followed by a msgpack body (bin type on, strings as
str, string map keys only, no ext types, no timestamps, never pickle). A length above the frame
limit is rejected before a byte of the body is read. Requests are ``{"id": int, "verb": str,
"deadline_ms": int (optional, relative to receipt), "args": {...}}``; replies are ``{"id", "ok":
True, "result": ...}`` or ``{"id", "ok": False, "error": {"code": str, "message": str}}``; a
connection-level refusal (malformed frame, oversized frame, wrong uid) has ``"id": nil`` and is
followed by the daemon closing the connection. Replies may come out of order.

Verbs (args -> result; ``h16`` is a 16-byte bin, leases and registrations belong to the
connection that made them):

  health      {}                                    -> {status, uptime_s, pid, version}
  stats       {}                                    -> store stats + {daemon: {...}}
  put         {namespace?: str, key: bin, value: bin} -> {stored: bool}
  get         {namespace?: str, key: bin}           -> {value: bin | nil, tier: str | nil}
  lookup      {namespace: h16, hashes: [h16], idents: [bin], lease_ttl_s?: num | nil}
                                                    -> {num_hit, tiers: [str], lease_id | nil}
              or, packed: {namespace, hashes_packed: bin (N x 16), idents_packed: bin (N x
              ident_len), ident_len: int in 1..MAX_IDENT_LEN, lease_ttl_s?}
                                                    -> {num_hit, tier_runs: [[str, count]],
                                                        lease_id | nil}
              (exactly one form per request; the packed reply's runs expand to ``tiers``)
  release     {lease_id}                            -> {released: bool}
  remove      {namespace: h16, hashes: [h16]}       -> {num_removed}
  register    {layout: KVLayout.to_wire(), engine_id: str}
                                                    -> {registration_id, num_blocks, block_bytes}
  unregister  {registration_id}                     -> {unregistered: bool}
  save        {registration_id, namespace: h16, block_ids: [int], hashes: [h16], idents: [bin]}
                                                    -> {outcomes: ["saved"|"duplicate"|"failed"],
                                                        num_saved}
  load        {registration_id, lease_id, block_ids: [int]}  -> {num_loaded}  (ends the lease)
  evicted     {namespace: h16, hashes: [h16], registration_id?: int | nil}
                                                    -> {num_acknowledged, num_withdrawn}
  resident    {registration_id, namespace: h16, block_ids: [int], hashes: [h16], idents: [bin],
               generations: [int]}                  -> {num_indexed}
              (the engine's full blocks at these ids, as of these block generations: the HBM
              tier; needs a layout with ``generations``; a lookup may then answer tier "hbm")
"""

from __future__ import annotations

import functools
import itertools
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from kvstore.keys import HASH_BYTES

HEADER = struct.Struct("<I")
HEADER_BYTES = HEADER.size
MAX_FRAME_BYTES = 256 * 1024 * 1024
MAX_NESTING = 32
MAX_REQUEST_ID = 2**63 - 1
DEFAULT_DEADLINE_MS = 30_000
MAX_DEADLINE_MS = 24 * 3600 * 1000
MAX_IDENT_LEN = 1 << 20  # one packed ident's bytes (lookup's ident_len)

# Error codes, the complete list a client can see.
BAD_REQUEST = "bad_request"
UNKNOWN_VERB = "unknown_verb"
MALFORMED_FRAME = "malformed_frame"
FRAME_TOO_LARGE = "frame_too_large"
DEADLINE_EXCEEDED = "deadline_exceeded"
PERMISSION_DENIED = "permission_denied"
NOT_FOUND = "not_found"
UNSUPPORTED = "unsupported"
STORE_ERROR = "store_error"
SHUTTING_DOWN = "shutting_down"
INTERNAL = "internal"


class ProtocolError(Exception):
    """A frame or request the peer got wrong; ``code`` is one of the error codes above."""

    def __init__(self, code: str, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


# ---------------------------------------------------------------------------------------- frames


def encode_frame(obj: Any, max_frame_bytes: int = MAX_FRAME_BYTES) -> list[bytes]:
    """The frame for ``obj`` as [header, body] (send both; avoids copying a large body)."""
    body = msgpack.packb(obj, use_bin_type=True)
    if len(body) > max_frame_bytes:
        raise ProtocolError(FRAME_TOO_LARGE,
                            f"frame of {len(body)} bytes exceeds the {max_frame_bytes}-byte limit")
    return [HEADER.pack(len(body)), body]


def frame_length(header: bytes, max_frame_bytes: int = MAX_FRAME_BYTES) -> int:
    """The body length a header announces; ProtocolError if it is over the limit."""
    (length,) = HEADER.unpack(header)
    if length > max_frame_bytes:
        raise ProtocolError(FRAME_TOO_LARGE,
                            f"frame of {length} bytes exceeds the {max_frame_bytes}-byte limit")
    return length


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(MALFORMED_FRAME, f"msgpack ext type {code} is not allowed")


_SCALARS = frozenset({type(None), bool, int, float, str, bytes})


def _check_plain(obj: Any, depth: int = 0) -> None:
    # msgpack decodes timestamps without calling ext_hook; walk the tree so only plain data passes.
    kind = type(obj)
    if kind in _SCALARS:
        return
    if depth >= MAX_NESTING:
        raise ProtocolError(MALFORMED_FRAME, f"frame nests deeper than {MAX_NESTING} levels")
    if kind is list:
        items = obj
    elif kind is dict:
        items = obj.values()
    else:
        raise ProtocolError(MALFORMED_FRAME, f"value of type {kind.__name__} is not allowed")
    if _SCALARS.issuperset(map(type, items)):  # the common case, at C speed: 1,024 hashes
        return
    for item in items:
        if type(item) not in _SCALARS:
            _check_plain(item, depth + 1)


# Bytes that start a msgpack map or array. Nesting d levels deep takes d of them.
_CONTAINER_BYTES = bytes([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])
_QUICK_CHECK_MAX_BYTES = 64 * 1024


def _surely_plain(body: bytes | bytearray | memoryview) -> bool:
    """True when the raw body cannot decode to anything ``_check_plain`` refuses (False: walk).

    The walk refuses timestamps and deep nesting. A timestamp is ext type -1, whatever the ext
    format, so its encoding holds a 0xff byte; nesting MAX_NESTING deep takes that many
    container headers. Payload bytes can only make this answer False, never wrongly True.
    """
    if len(body) > _QUICK_CHECK_MAX_BYTES:
        return False
    if isinstance(body, memoryview):
        body = body.tobytes()
    return b"\xff" not in body and \
        len(body) - len(body.translate(None, _CONTAINER_BYTES)) < MAX_NESTING


def decode_body(body: bytes | bytearray | memoryview, check_plain: bool = True) -> Any:
    """Decode one frame body into plain data; ProtocolError(malformed_frame) otherwise.

    ``check_plain=False`` skips the walk that rejects msgpack timestamps; only for bodies that go
    straight to ``parse_request``, whose schemas accept nothing but plain types.
    """
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True,
                              ext_hook=_reject_ext)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types (ValueError, ExtraData, ...)
        raise ProtocolError(MALFORMED_FRAME, f"undecodable msgpack body: {exc}") from None
    if check_plain and not _surely_plain(body):
        _check_plain(obj)
    return obj


class FrameDecoder:
    """Incremental decoder: ``feed`` bytes as they arrive, get back every complete message.

    After a ProtocolError the stream is unusable (the peer gets an error reply and is closed).
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._need: int | None = None  # body length once the header is in

    def feed(self, data: bytes | bytearray | memoryview) -> list[Any]:
        self._buf += data
        out: list[Any] = []
        while True:
            if self._need is None:
                if len(self._buf) < HEADER_BYTES:
                    return out
                self._need = frame_length(bytes(self._buf[:HEADER_BYTES]), self.max_frame_bytes)
                del self._buf[:HEADER_BYTES]
            if len(self._buf) < self._need:
                return out
            body = bytes(self._buf[:self._need])
            del self._buf[:self._need]
            self._need = None
            out.append(decode_body(body))

    @property
    def pending_bytes(self) -> int:
        return len(self._buf)


# -------------------------------------------------------------------------------------- envelopes


@dataclass(frozen=True)
class Request:
    request_id: int
    verb: str
    deadline_ms: int
    args: dict[str, Any]


def parse_request(obj: Any, default_deadline_ms: int = DEFAULT_DEADLINE_MS) -> Request:
    """Validate the envelope and the verb's args.

    An envelope that is not a map with an integer id raises MALFORMED_FRAME (the connection is
    closed); an unknown verb or bad args raise UNKNOWN_VERB / BAD_REQUEST carrying the request id.
    """
    if not isinstance(obj, dict):
        raise ProtocolError(MALFORMED_FRAME, f"a request must be a map, got {_kind(obj)}")
    request_id = obj.get("id")
    if type(request_id) is not int or not 0 <= request_id <= MAX_REQUEST_ID:
        raise ProtocolError(MALFORMED_FRAME, "a request needs an integer 'id' in 0..2**63-1")
    extra = set(obj) - {"id", "verb", "deadline_ms", "args"}
    if extra:
        raise ProtocolError(BAD_REQUEST, f"unknown request fields: {sorted(extra)}", request_id)
    verb = obj.get("verb")
    if not isinstance(verb, str):
        raise ProtocolError(BAD_REQUEST, "a request needs a string 'verb'", request_id)
    if verb not in SCHEMAS:
        raise ProtocolError(UNKNOWN_VERB, f"unknown verb {verb[:64]!r}; known: {sorted(SCHEMAS)}",
                            request_id)
    deadline_ms = obj.get("deadline_ms", default_deadline_ms)
    if deadline_ms is None:
        deadline_ms = default_deadline_ms
    if type(deadline_ms) is not int or not 0 < deadline_ms <= MAX_DEADLINE_MS:
        raise ProtocolError(BAD_REQUEST, f"deadline_ms must be an integer in 1..{MAX_DEADLINE_MS}",
                            request_id)
    args = obj.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ProtocolError(BAD_REQUEST, f"'args' must be a map, got {_kind(args)}", request_id)
    try:
        validate_args(verb, args)
    except ProtocolError as exc:
        exc.request_id = request_id
        raise
    return Request(request_id, verb, deadline_ms, args)


def ok_reply(request_id: int | None, result: Any) -> dict:
    return {"id": request_id, "ok": True, "result": result}


def error_reply(request_id: int | None, code: str, message: str) -> dict:
    return {"id": request_id, "ok": False, "error": {"code": code, "message": message}}


# ---------------------------------------------------------------------------------------- schemas

Check = Callable[[Any], bool]


def _kind(value: Any) -> str:
    return "nil" if value is None else type(value).__name__


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_uint(v: Any) -> bool:
    return type(v) is int and v >= 0


def _is_number(v: Any) -> bool:
    return type(v) in (int, float) and v == v  # NaN is not a duration


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_bytes(v: Any) -> bool:
    return isinstance(v, bytes)


def _is_hash(v: Any) -> bool:
    return isinstance(v, bytes) and len(v) == HASH_BYTES


def _is_map(v: Any) -> bool:
    if type(v) is not dict:
        return False
    try:
        _check_plain(v)  # a free-form map: the one place a timestamp could hide
    except ProtocolError:
        return False
    return True


def _list_of(check: Check) -> Check:
    return lambda v: type(v) is list and all(check(x) for x in v)


def _optional(check: Check) -> Check:
    return lambda v: v is None or check(v)


# The list checks below run on every lookup of 1,024 hashes, so they stay in C: bytes.join
# accepts only bytes-like items, and decoded msgpack holds no bytes-like type but bytes.
def _all_bytes(v: list) -> bool:
    try:
        b"".join(v)
    except TypeError:
        return False
    return True


def _HASHES(v: Any) -> bool:  # noqa: N802
    return type(v) is list and _all_bytes(v) and {HASH_BYTES}.issuperset(map(len, v))


def _BYTES_LIST(v: Any) -> bool:  # noqa: N802
    return type(v) is list and _all_bytes(v)


def _UINTS(v: Any) -> bool:  # noqa: N802
    return type(v) is list and {int}.issuperset(map(type, v)) and (not v or min(v) >= 0)


@dataclass(frozen=True)
class Field:
    check: Check
    expect: str  # what the check wants, for the error message
    required: bool = True


SCHEMAS: dict[str, dict[str, Field]] = {
    "health": {},
    "stats": {},
    "put": {
        "namespace": Field(_is_str, "str", required=False),
        "key": Field(_is_bytes, "bin"),
        "value": Field(_is_bytes, "bin"),
    },
    "get": {
        "namespace": Field(_is_str, "str", required=False),
        "key": Field(_is_bytes, "bin"),
    },
    "lookup": {  # hashes + idents, or the packed three: _check_lookup_forms
        "namespace": Field(_is_hash, "bin of 16 bytes"),
        "hashes": Field(_HASHES, "array of 16-byte bin", required=False),
        "idents": Field(_BYTES_LIST, "array of bin", required=False),
        "hashes_packed": Field(_is_bytes, "bin", required=False),
        "idents_packed": Field(_is_bytes, "bin", required=False),
        "ident_len": Field(_is_int, "int", required=False),
        "lease_ttl_s": Field(_optional(_is_number), "number or nil", required=False),
    },
    "release": {"lease_id": Field(_is_uint, "non-negative int")},
    "remove": {
        "namespace": Field(_is_hash, "bin of 16 bytes"),
        "hashes": Field(_HASHES, "array of 16-byte bin"),
    },
    "register": {
        "layout": Field(_is_map, "map (KVLayout.to_wire())"),
        "engine_id": Field(_is_str, "str"),
    },
    "unregister": {"registration_id": Field(_is_uint, "non-negative int")},
    "save": {
        "registration_id": Field(_is_uint, "non-negative int"),
        "namespace": Field(_is_hash, "bin of 16 bytes"),
        "block_ids": Field(_UINTS, "array of non-negative int"),
        "hashes": Field(_HASHES, "array of 16-byte bin"),
        "idents": Field(_BYTES_LIST, "array of bin"),
    },
    "load": {
        "registration_id": Field(_is_uint, "non-negative int"),
        "lease_id": Field(_is_uint, "non-negative int"),
        "block_ids": Field(_UINTS, "array of non-negative int"),
    },
    "evicted": {
        "namespace": Field(_is_hash, "bin of 16 bytes"),
        "hashes": Field(_HASHES, "array of 16-byte bin"),
        "registration_id": Field(_optional(_is_uint), "non-negative int or nil", required=False),
    },
    "resident": {
        "registration_id": Field(_is_uint, "non-negative int"),
        "namespace": Field(_is_hash, "bin of 16 bytes"),
        "block_ids": Field(_UINTS, "array of non-negative int"),
        "hashes": Field(_HASHES, "array of 16-byte bin"),
        "idents": Field(_BYTES_LIST, "array of bin"),
        "generations": Field(_UINTS, "array of non-negative int"),
    },
}

# Arrays that must pair up one to one.
_SAME_LENGTH: dict[str, tuple[str, ...]] = {
    "lookup": ("hashes", "idents"),
    "save": ("block_ids", "hashes", "idents"),
    "resident": ("block_ids", "hashes", "idents", "generations"),
}


def validate_args(verb: str, args: dict[str, Any]) -> None:
    """Raise ProtocolError(bad_request) unless ``args`` matches the verb's schema exactly."""
    schema = SCHEMAS[verb]
    unknown = set(args) - set(schema)
    if unknown:
        raise ProtocolError(BAD_REQUEST, f"{verb}: unknown args {sorted(map(str, unknown))}")
    for name, field in schema.items():
        if name not in args:
            if field.required:
                raise ProtocolError(BAD_REQUEST, f"{verb}: missing arg {name!r} ({field.expect})")
            continue
        if not field.check(args[name]):
            raise ProtocolError(BAD_REQUEST, f"{verb}: arg {name!r} must be {field.expect}, "
                                             f"got {_kind(args[name])}")
    if verb == "lookup":
        _check_lookup_forms(args)
    group = _SAME_LENGTH.get(verb)
    if group and group[0] in args:
        lengths = {name: len(args[name]) for name in group}
        if len(set(lengths.values())) > 1:
            raise ProtocolError(BAD_REQUEST, f"{verb}: {', '.join(group)} must have equal "
                                             f"lengths, got {lengths}")


_LOOKUP_LISTS = ("hashes", "idents")
_LOOKUP_PACKED = ("hashes_packed", "idents_packed", "ident_len")


def _check_lookup_forms(args: dict[str, Any]) -> None:
    """Exactly one of the list form and the packed form, complete; packed lengths consistent."""
    lists = [name for name in _LOOKUP_LISTS if name in args]
    packed = [name for name in _LOOKUP_PACKED if name in args]
    if lists and packed:
        raise ProtocolError(BAD_REQUEST, f"lookup: give either {'/'.join(_LOOKUP_LISTS)} or "
                                         f"{'/'.join(_LOOKUP_PACKED)}, not both")
    if not packed:
        missing = [name for name in _LOOKUP_LISTS if name not in args]
        if missing:
            raise ProtocolError(BAD_REQUEST, f"lookup: missing arg {missing[0]!r} (or the packed "
                                             f"form {'/'.join(_LOOKUP_PACKED)})")
        return
    missing = [name for name in _LOOKUP_PACKED if name not in args]
    if missing:
        raise ProtocolError(BAD_REQUEST, f"lookup: packed form is missing {missing}")
    ident_len = args["ident_len"]
    if not 1 <= ident_len <= MAX_IDENT_LEN:
        raise ProtocolError(BAD_REQUEST, f"lookup: ident_len must be in 1..{MAX_IDENT_LEN}, "
                                         f"got {ident_len}")
    num_hash_bytes, num_ident_bytes = len(args["hashes_packed"]), len(args["idents_packed"])
    if num_hash_bytes % HASH_BYTES:
        raise ProtocolError(BAD_REQUEST, f"lookup: hashes_packed length {num_hash_bytes} is not "
                                         f"a multiple of {HASH_BYTES}")
    if num_ident_bytes % ident_len:
        raise ProtocolError(BAD_REQUEST, f"lookup: idents_packed length {num_ident_bytes} is "
                                         f"not a multiple of ident_len {ident_len}")
    if num_hash_bytes // HASH_BYTES != num_ident_bytes // ident_len:
        raise ProtocolError(BAD_REQUEST, f"lookup: {num_hash_bytes // HASH_BYTES} hashes but "
                                         f"{num_ident_bytes // ident_len} idents")


@functools.lru_cache(maxsize=64)
def _splitter(count: int, item_len: int) -> struct.Struct:
    return struct.Struct(f"{item_len}s" * count)


def split_packed(data: bytes, item_len: int) -> list[bytes]:
    """``data`` (a multiple of ``item_len`` bytes, already validated) cut into its items, in C."""
    if not data:
        return []
    return list(_splitter(len(data) // item_len, item_len).unpack(data))


def lookup_items(args: dict[str, Any]) -> tuple[list[bytes], list[bytes], bool]:
    """A validated lookup's (hashes, idents, packed) whichever form it came in."""
    if "hashes_packed" not in args:
        return args["hashes"], args["idents"], False
    return (split_packed(args["hashes_packed"], HASH_BYTES),
            split_packed(args["idents_packed"], args["ident_len"]), True)


def pack_lookup(hashes: list[bytes], idents: list[bytes]) -> dict[str, Any] | None:
    """The packed lookup args for these lists, or None when they do not fit the packed form
    (idents of unequal lengths, an empty or oversized ident, a hash of the wrong size)."""
    if not idents:
        return None
    ident_len = len(idents[0])
    if not 1 <= ident_len <= MAX_IDENT_LEN or len(hashes) != len(idents):
        return None
    try:
        hashes_packed, idents_packed = b"".join(hashes), b"".join(idents)
    except TypeError:
        return None
    # Equal total lengths with every item at least as long would still allow 15 + 17: check each.
    if len(hashes_packed) != HASH_BYTES * len(hashes) or len(idents_packed) != \
            ident_len * len(idents) or not {ident_len}.issuperset(map(len, idents)) or \
            not {HASH_BYTES}.issuperset(map(len, hashes)):
        return None
    return {"hashes_packed": hashes_packed, "idents_packed": idents_packed,
            "ident_len": ident_len}


def tier_runs(tiers: list[str]) -> list[list]:
    """Run-length form of a lookup's per-block tiers: ``[[tier, count], ...]``."""
    if not tiers:
        return []
    first = tiers[0]
    if tiers.count(first) == len(tiers):
        return [[getattr(first, "value", first), len(tiers)]]  # a Tier goes out as its value
    return [[getattr(tier, "value", tier), len(list(group))]
            for tier, group in itertools.groupby(tiers)]


def expand_tier_runs(runs: list) -> list[str]:
    """The per-block tiers back from ``tier_runs``."""
    tiers: list[str] = []
    for tier, count in runs:
        tiers += [tier] * count
    return tiers
