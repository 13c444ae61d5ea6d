"""Control-protocol frames: a 4-byte little-endian body length, then a msgpack body.

The body is plain data only: bin type on, strings as str, string map keys only, no ext types, no
timestamps, never pickle. A length above the frame limit is rejected before a byte of the body
is read. Also the error codes a client can see, and the error that carries one.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

HEADER = struct.Struct("<I")
HEADER_BYTES = HEADER.size
MAX_FRAME_BYTES = 256 * 1024 * 1024
# A put's value is at most this: its get's reply (the value and an envelope of well under 100
# bytes) must fit one frame, or the value could be stored and never read back.
MAX_VALUE_BYTES = MAX_FRAME_BYTES - 4096
MAX_NESTING = 32
MAX_REQUEST_ID = 2**63 - 1
DEFAULT_DEADLINE_MS = 30_000
MAX_DEADLINE_MS = 24 * 3600 * 1000
MAX_IDENT_LEN = 1 << 20  # one packed ident's bytes (lookup's ident_len)

# The protocol's version, "MAJOR.MINOR": a client and a daemon of one major understand each
# other (a minor adds, never changes); they say theirs in the first exchange (the ``hello`` verb).
# Daemons from before the handshake answer it ``unknown_verb``: they speak 1.0.
# 1.2: the ``engines`` verb. 1.3: the hello's answer names the daemon's CLOCK_MONOTONIC
# (``mono``); a client on the same clock stamps each request with when it was sent
# (``sent_mono``), and its deadline runs from then, not from when the daemon read it.
# 1.4: the ``lookup_load`` verb. 1.5: the hello's answer names the daemon's key filter
# (``key_filter``: its file and whether a miss in it is certain; ``kvstore/key_filter.py``).
PROTOCOL_VERSION = "1.5"
PRE_HANDSHAKE_VERSION = "1.0"
# The verbs a minor added, by the version that added them: a client asks a daemon that speaks
# an older minor only what that minor knows.
VERB_SINCE = {"engines": "1.2", "lookup_load": "1.4"}

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
RESOURCE_EXHAUSTED = "resource_exhausted"  # connection cap, buffer budget, timeouts
PROTOCOL_MISMATCH = "protocol_mismatch"  # a hello of another major version
INTERNAL = "internal"


class ProtocolError(Exception):
    """A frame or request the peer got wrong; ``code`` is one of the error codes above."""

    def __init__(self, code: str, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id




def protocol_major(version: str) -> int:
    """The major of a "MAJOR.MINOR" protocol version; ValueError if it is not one."""
    major, sep, minor = version.partition(".")
    if not (sep and major.isdigit() and minor.isdigit()):
        raise ValueError(f"not a MAJOR.MINOR protocol version: {version[:32]!r}")
    return int(major)


def knows_verb(version: str | None, verb: str) -> bool:
    """Whether a daemon speaking ``version`` (None: not known yet) answers ``verb``: a verb of
    1.0, or one its minor added (``VERB_SINCE``) at or before ``version``, same major."""
    since = VERB_SINCE.get(verb)
    if since is None:
        return True
    if version is None:
        return False
    try:
        theirs, ours = protocol_major(version), protocol_major(since)
    except ValueError:
        return False
    return theirs == ours and int(version.partition(".")[2]) >= int(since.partition(".")[2])


def kind_of(value: Any) -> str:
    """A value's type as error messages name it (``nil`` for None)."""
    return "nil" if value is None else type(value).__name__



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


def ensure_plain(obj: Any, depth: int = 0) -> None:
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
            ensure_plain(item, depth + 1)


# Bytes that start a msgpack map or array. Nesting d levels deep takes d of them.
_CONTAINER_BYTES = bytes([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])
_QUICK_CHECK_MAX_BYTES = 64 * 1024


def _surely_plain(body: bytes | bytearray | memoryview) -> bool:
    """True when the raw body cannot decode to anything ``ensure_plain`` refuses (False: walk).

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
        ensure_plain(obj)
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
