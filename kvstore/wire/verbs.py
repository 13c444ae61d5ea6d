"""Per-verb argument schemas of the control protocol, and the packed lookup form.

Every verb's args are checked against its schema before a handler runs: unknown args, missing
ones and wrong types are a ProtocolError(bad_request) naming the arg. The list checks run on
every lookup of 1,024 hashes, so they stay in C.
"""

from __future__ import annotations

import functools
import itertools
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.keys import HASH_BYTES
from kvstore.wire.framing import (
    BAD_REQUEST,
    MAX_IDENT_LEN,
    MAX_VALUE_BYTES,
    ProtocolError,
    ensure_plain,
    kind_of,
)

Check = Callable[[Any], bool]

# A locate walks the chain under the store's and the HBM index's locks: at most this many blocks
# (a million tokens at 16 per block, beyond any model's context).
MAX_LOCATE_BLOCKS = 1 << 16


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


def _is_value(v: Any) -> bool:
    return isinstance(v, bytes) and len(v) <= MAX_VALUE_BYTES


def _is_hash(v: Any) -> bool:
    return isinstance(v, bytes) and len(v) == HASH_BYTES


def _is_map(v: Any) -> bool:
    if type(v) is not dict:
        return False
    try:
        ensure_plain(v)  # a free-form map: the one place a timestamp could hide
    except ProtocolError:
        return False
    return True


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


# A chain of blocks (lookup, locate): hashes + idents, or the packed three.
_CHAIN_FIELDS = {
    "namespace": Field(_is_hash, "bin of 16 bytes"),
    "hashes": Field(_HASHES, "array of 16-byte bin", required=False),
    "idents": Field(_BYTES_LIST, "array of bin", required=False),
    "hashes_packed": Field(_is_bytes, "bin", required=False),
    "idents_packed": Field(_is_bytes, "bin", required=False),
    "ident_len": Field(_is_int, "int", required=False),
}

SCHEMAS: dict[str, dict[str, Field]] = {
    "hello": {"protocol": Field(_is_str, "str"), "client": Field(_is_str, "str", required=False)},
    "health": {},
    "stats": {},
    "engines": {},
    "put": {
        "namespace": Field(_is_str, "str", required=False),
        "key": Field(_is_bytes, "bin"),
        "value": Field(_is_value, f"bin of at most {MAX_VALUE_BYTES} bytes (a get's reply must "
                                  "fit one frame)"),
    },
    "get": {
        "namespace": Field(_is_str, "str", required=False),
        "key": Field(_is_bytes, "bin"),
    },
    # hashes + idents, or the packed three: _check_lookup_forms
    "lookup": {**_CHAIN_FIELDS,
               "lease_ttl_s": Field(_optional(_is_number), "number or nil", required=False)},
    "locate": dict(_CHAIN_FIELDS),  # lookup's two forms, without a lease
    # lookup's args plus where a hit lands: one engine block per hash asked (checked in
    # the handler, since the chain may come packed)
    "lookup_load": {**_CHAIN_FIELDS,
                    "lease_ttl_s": Field(_optional(_is_number), "number or nil", required=False),
                    "registration_id": Field(_is_uint, "non-negative int"),
                    "block_ids": Field(_UINTS, "array of non-negative int"),
                    "min_blocks": Field(_is_uint, "non-negative int", required=False)},
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
    "lookup_load": ("hashes", "idents"),
    "locate": ("hashes", "idents"),
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
                                             f"got {kind_of(args[name])}")
    if verb in ("lookup", "lookup_load", "locate"):
        _check_lookup_forms(verb, args)
    group = _SAME_LENGTH.get(verb)
    if group and group[0] in args:
        lengths = {name: len(args[name]) for name in group}
        if len(set(lengths.values())) > 1:
            raise ProtocolError(BAD_REQUEST, f"{verb}: {', '.join(group)} must have equal "
                                             f"lengths, got {lengths}")


_LOOKUP_LISTS = ("hashes", "idents")
_LOOKUP_PACKED = ("hashes_packed", "idents_packed", "ident_len")


def _check_lookup_forms(verb: str, args: dict[str, Any]) -> None:
    """Exactly one of the list form and the packed form, complete; packed lengths consistent;
    a locate's chain at most MAX_LOCATE_BLOCKS long."""
    lists = [name for name in _LOOKUP_LISTS if name in args]
    packed = [name for name in _LOOKUP_PACKED if name in args]
    if lists and packed:
        raise ProtocolError(BAD_REQUEST, f"{verb}: give either {'/'.join(_LOOKUP_LISTS)} or "
                                         f"{'/'.join(_LOOKUP_PACKED)}, not both")
    if not packed:
        missing = [name for name in _LOOKUP_LISTS if name not in args]
        if missing:
            raise ProtocolError(BAD_REQUEST, f"{verb}: missing arg {missing[0]!r} (or the packed "
                                             f"form {'/'.join(_LOOKUP_PACKED)})")
        _check_chain_length(verb, len(args["hashes"]))
        return
    missing = [name for name in _LOOKUP_PACKED if name not in args]
    if missing:
        raise ProtocolError(BAD_REQUEST, f"{verb}: packed form is missing {missing}")
    ident_len = args["ident_len"]
    if not 1 <= ident_len <= MAX_IDENT_LEN:
        raise ProtocolError(BAD_REQUEST, f"{verb}: ident_len must be in 1..{MAX_IDENT_LEN}, "
                                         f"got {ident_len}")
    num_hash_bytes, num_ident_bytes = len(args["hashes_packed"]), len(args["idents_packed"])
    if num_hash_bytes % HASH_BYTES:
        raise ProtocolError(BAD_REQUEST, f"{verb}: hashes_packed length {num_hash_bytes} is not "
                                         f"a multiple of {HASH_BYTES}")
    if num_ident_bytes % ident_len:
        raise ProtocolError(BAD_REQUEST, f"{verb}: idents_packed length {num_ident_bytes} is "
                                         f"not a multiple of ident_len {ident_len}")
    if num_hash_bytes // HASH_BYTES != num_ident_bytes // ident_len:
        raise ProtocolError(BAD_REQUEST, f"{verb}: {num_hash_bytes // HASH_BYTES} hashes but "
                                         f"{num_ident_bytes // ident_len} idents")
    _check_chain_length(verb, num_hash_bytes // HASH_BYTES)


def _check_chain_length(verb: str, num_blocks: int) -> None:
    """A lookup is bounded by the frame size alone; a locate also by MAX_LOCATE_BLOCKS."""
    if verb == "locate" and num_blocks > MAX_LOCATE_BLOCKS:
        raise ProtocolError(BAD_REQUEST, f"locate: at most {MAX_LOCATE_BLOCKS} blocks per "
                                         f"request, got {num_blocks}")


@functools.lru_cache(maxsize=64)
def _splitter(count: int, item_len: int) -> struct.Struct:
    return struct.Struct(f"{item_len}s" * count)


_SPLIT_ITEMS = 1 << 14  # items cut in one C call: the GIL changes hands between calls


def split_packed(data: bytes, item_len: int) -> list[bytes]:
    """``data`` (a multiple of ``item_len`` bytes, already validated) cut into its items, in C,
    a slice of at most ``_SPLIT_ITEMS`` a call (a million items in one call held the GIL, and
    with it the daemon's event loop, for a tenth of a second)."""
    num_items = len(data) // item_len
    if num_items <= _SPLIT_ITEMS:
        return list(_splitter(num_items, item_len).unpack(data)) if data else []
    items: list[bytes] = []
    whole = _splitter(_SPLIT_ITEMS, item_len)
    for start in range(0, num_items, _SPLIT_ITEMS):
        count = min(_SPLIT_ITEMS, num_items - start)
        splitter = whole if count == _SPLIT_ITEMS else _splitter(count, item_len)
        items += splitter.unpack_from(data, start * item_len)
    return items


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
