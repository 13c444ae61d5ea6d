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

  hello       {protocol: "MAJOR.MINOR", client?: str} -> {protocol, daemon}  (a client's first
              request; another major is refused with ``protocol_mismatch``, naming both)
  health      {}                                    -> {status, uptime_s, pid, version}
  stats       {}                                    -> store stats + {daemon: {...}}
  engines     {}                                    -> {engines: [{registration_id, engine_id,
                                                        device, model_identity | nil,
                                                        num_shards}]}
              (the registered engines and the block-key identity each declared in its
              layout's meta: how a router keys a hosted engine's blocks, e.g. vLLM's)
  put         {namespace?: str, key: bin, value: bin} -> {stored: bool, replaced: bool}
  get         {namespace?: str, key: bin}           -> {value: bin | nil, tier: str | nil}
  lookup      {namespace: h16, hashes: [h16], idents: [bin], lease_ttl_s?: num | nil}
                                                    -> {num_hit, tiers: [str], lease_id | nil}
              or, packed: {namespace, hashes_packed: bin (N x 16), idents_packed: bin (N x
              ident_len), ident_len: int in 1..MAX_IDENT_LEN, lease_ttl_s?}
                                                    -> {num_hit, tier_runs: [[str, count]],
                                                        lease_id | nil}
              (exactly one form per request; the packed reply's runs expand to ``tiers``)
  locate      {namespace: h16, hashes: [h16], idents: [bin]} or lookup's packed form (at most
              MAX_LOCATE_BLOCKS)              -> {num_blocks, engines: [{registration_id,
                                                  engine_id, device, num_hbm}], tier_runs}
              (no lease, no trace: per registered engine the leading blocks resident in its
              arena, and the store's verified prefix as [[tier, count]] runs)
  release     {lease_id}                            -> {released: bool}
  remove      {namespace: h16, hashes: [h16]}       -> {num_removed}
  register    {layout: KVLayout.to_wire(), engine_id: str}
                                                    -> {registration_id, num_blocks, block_bytes}
              (CPU memory goes as file descriptors with the frame, SCM_RIGHTS: ``fds.py``;
              handles index them. Only ``register`` takes descriptors; a name is refused)
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

Frames are in ``framing.py``, the verbs' schemas in ``verbs.py``; this module holds the envelopes
and is the one namespace the client and the daemon use (``from kvstore.wire import protocol``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvstore.wire.framing import (
    BAD_REQUEST,
    DEADLINE_EXCEEDED,
    DEFAULT_DEADLINE_MS,
    FRAME_TOO_LARGE,
    HEADER,
    HEADER_BYTES,
    INTERNAL,
    MALFORMED_FRAME,
    MAX_DEADLINE_MS,
    MAX_FRAME_BYTES,
    MAX_IDENT_LEN,
    MAX_NESTING,
    MAX_REQUEST_ID,
    MAX_VALUE_BYTES,
    NOT_FOUND,
    PERMISSION_DENIED,
    PRE_HANDSHAKE_VERSION,
    PROTOCOL_MISMATCH,
    PROTOCOL_VERSION,
    RESOURCE_EXHAUSTED,
    SHUTTING_DOWN,
    STORE_ERROR,
    UNKNOWN_VERB,
    UNSUPPORTED,
    VERB_SINCE,
    FrameDecoder,
    ProtocolError,
    decode_body,
    encode_frame,
    frame_length,
    kind_of,
    knows_verb,
    protocol_major,
)
from kvstore.wire.verbs import (
    SCHEMAS,
    expand_tier_runs,
    lookup_items,
    pack_lookup,
    split_packed,
    tier_runs,
    validate_args,
)

__all__ = [
    "BAD_REQUEST", "DEADLINE_EXCEEDED", "DEFAULT_DEADLINE_MS", "FRAME_TOO_LARGE", "HEADER",
    "HEADER_BYTES", "INTERNAL", "MALFORMED_FRAME", "MAX_DEADLINE_MS", "MAX_FRAME_BYTES",
    "MAX_IDENT_LEN", "MAX_NESTING", "MAX_REQUEST_ID", "MAX_VALUE_BYTES",
    "NOT_FOUND", "PERMISSION_DENIED",
    "PRE_HANDSHAKE_VERSION", "PROTOCOL_MISMATCH", "PROTOCOL_VERSION", "protocol_major",
    "RESOURCE_EXHAUSTED", "SCHEMAS", "SHUTTING_DOWN", "STORE_ERROR", "UNKNOWN_VERB",
    "UNSUPPORTED", "VERB_SINCE", "FrameDecoder", "knows_verb",
    "ProtocolError", "Request", "decode_body", "encode_frame", "error_reply", "expand_tier_runs",
    "frame_length", "lookup_items", "ok_reply", "pack_lookup", "parse_request", "split_packed",
    "tier_runs", "validate_args",
]



@dataclass(frozen=True)
class Request:
    request_id: int
    verb: str
    deadline_ms: int
    args: dict[str, Any]
    sent_mono: float | None = None  # the client's CLOCK_MONOTONIC when it sent it (1.3)


def parse_request(obj: Any, default_deadline_ms: int = DEFAULT_DEADLINE_MS) -> Request:
    """Validate the envelope and the verb's args.

    An envelope that is not a map with an integer id raises MALFORMED_FRAME (the connection is
    closed); an unknown verb or bad args raise UNKNOWN_VERB / BAD_REQUEST carrying the request id.
    """
    if not isinstance(obj, dict):
        raise ProtocolError(MALFORMED_FRAME, f"a request must be a map, got {kind_of(obj)}")
    request_id = obj.get("id")
    if type(request_id) is not int or not 0 <= request_id <= MAX_REQUEST_ID:
        raise ProtocolError(MALFORMED_FRAME, "a request needs an integer 'id' in 0..2**63-1")
    extra = set(obj) - {"id", "verb", "deadline_ms", "args", "sent_mono"}
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
        raise ProtocolError(BAD_REQUEST, f"'args' must be a map, got {kind_of(args)}", request_id)
    sent_mono = obj.get("sent_mono")
    if sent_mono is not None and (type(sent_mono) not in (int, float)
                                  or not math.isfinite(sent_mono)):
        raise ProtocolError(BAD_REQUEST, "sent_mono must be a finite number of seconds",
                            request_id)
    try:
        validate_args(verb, args)
    except ProtocolError as exc:
        exc.request_id = request_id
        raise
    return Request(request_id, verb, deadline_ms, args,
                   None if sent_mono is None else float(sent_mono))


def ok_reply(request_id: int | None, result: Any) -> dict:
    return {"id": request_id, "ok": True, "result": result}


def error_reply(request_id: int | None, code: str, message: str) -> dict:
    return {"id": request_id, "ok": False, "error": {"code": code, "message": message}}
