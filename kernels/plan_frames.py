"""The frames between the engine and its cuDNN plan builder's child (``kernels/plan_builder.py``),
both ways: a 4-byte big-endian length, a JSON header (its ``size``: the raw bytes after it), then
those bytes (a serialized graph). Plan keys travel as JSON lists (``encode_key``/``decode_key``).
Every read has a bound: a header past ``MAX_HEADER_BYTES`` or a blob past ``MAX_BLOB_BYTES`` is
refused (ValueError), as is a stream that ends inside a frame.
"""

from __future__ import annotations

import json
import struct
from typing import IO, Any

MAX_HEADER_BYTES = 1 << 16
MAX_BLOB_BYTES = 16 << 20  # a serialized SDPA plan is tens of KiB


def encode_key(key: tuple) -> Any:
    """A plan key as JSON (tuples become lists; ``decode_key`` turns them back)."""
    return [encode_key(part) if isinstance(part, tuple) else part for part in key]


def decode_key(value: Any) -> tuple:
    if not isinstance(value, list):
        raise ValueError(f"a plan key is a list, not {type(value).__name__}")
    return tuple(decode_key(part) if isinstance(part, list) else part for part in value)


def encode_frame(header: dict, blob: bytes = b"") -> bytes:
    """One frame's bytes; TypeError where the header holds what JSON cannot carry."""
    head = json.dumps(dict(header, size=len(blob))).encode()
    return struct.pack(">I", len(head)) + head + blob


def write_frame(stream: IO[bytes], header: dict, blob: bytes = b"") -> None:
    stream.write(encode_frame(header, blob))
    stream.flush()


def read_frame(stream: IO[bytes]) -> tuple[dict, bytes] | None:
    """The next frame, or None at the end of the stream; ValueError on a malformed one."""
    prefix = _read_exactly(stream, 4)
    if prefix is None:
        return None
    (length,) = struct.unpack(">I", prefix)
    if not 0 < length <= MAX_HEADER_BYTES:
        raise ValueError(f"a frame header of {length} bytes")
    head = _read_exactly(stream, length)
    if head is None:
        raise ValueError("the stream ended inside a frame header")
    header = json.loads(head)
    size = header.get("size", 0) if isinstance(header, dict) else -1
    if not isinstance(size, int) or not 0 <= size <= MAX_BLOB_BYTES:
        raise ValueError(f"a frame of {size!r} bytes")
    blob = _read_exactly(stream, size) if size else b""
    if blob is None:
        raise ValueError("the stream ended inside a frame")
    return header, blob


def _read_exactly(stream: IO[bytes], n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = stream.read(n - got)
        if not chunk:
            if got:
                raise ValueError(f"the stream ended after {got} of {n} bytes")
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
