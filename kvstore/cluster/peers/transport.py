"""The wire protocol between daemons over UCX: message tags, msgpack frames, block checksums.

One UCX endpoint carries one request at a time. Every message is tagged (ints only: ucxx hashes
the tag, and Python's str hash differs between processes):

    client → server   REQ_LEN (u64 LE)  REQ    msgpack {v, ns, hashes, idents, timeout_ms}
    server → client   RESP_LEN (u64 LE) RESP   msgpack {v, blocks: [[hash, ident, nbytes, xxh3]],
                                                        error}
    server → client   PAYLOAD + i       the bytes of block i, for each non-empty entry of blocks

The server (``server.py``) answers with the verified prefix its store holds; the client
(``client.py``) checks every entry against what it asked for and every payload against its
XXH3-64 before a block counts. A surprise of any kind ends the answer and drops the endpoint.
"""

from __future__ import annotations

import contextlib

import msgpack
import numpy as np
import xxhash

from kvstore.keys import HASH_BYTES

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 << 20
TAG_REQ_LEN, TAG_REQ, TAG_RESP_LEN, TAG_RESP = 1, 2, 3, 4
TAG_PAYLOAD = 1 << 32
ABORT_PERIOD_NS = 100_000_000  # how long dropping an endpoint may wait for UCX to let go


class ProtocolError(ValueError):
    """A peer sent something the protocol does not allow."""


def checksum(data: memoryview | bytes | np.ndarray) -> int:
    """The per-block payload checksum (XXH3-64)."""
    return xxhash.xxh3_64_intdigest(data)


async def send_frame(ep, tag_len: int, tag_body: int, obj: object) -> None:
    """One msgpack frame: its length (u64 LE) then its bytes, as two tagged messages."""
    body = np.frombuffer(msgpack.packb(obj, use_bin_type=True), dtype=np.uint8)
    await ep.send(np.array([body.nbytes], dtype="<u8"), tag=tag_len)
    if body.nbytes:
        await ep.send(body, tag=tag_body)


async def recv_frame(ep, tag_len: int, tag_body: int) -> object:
    """The counterpart of ``send_frame``; ProtocolError on a length over MAX_FRAME_BYTES."""
    length = np.empty(1, dtype="<u8")
    await ep.recv(length, tag=tag_len)
    num_bytes = int(length[0])
    if num_bytes > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {num_bytes} B is over the {MAX_FRAME_BYTES} B limit")
    body = np.empty(num_bytes, dtype=np.uint8)
    if num_bytes:
        await ep.recv(body, tag=tag_body)
    try:
        return msgpack.unpackb(body.tobytes(), raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from None


def parse_request(request: object, max_blocks: int) -> tuple[bytes, list[bytes], list[bytes],
                                                              float]:
    """(namespace, hashes, idents, timeout_s) of a fetch request; ProtocolError if malformed."""
    if not isinstance(request, dict) or request.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("unsupported request version")
    ns, hashes, idents = request.get("ns"), request.get("hashes"), request.get("idents")
    if not isinstance(ns, bytes) or len(ns) != HASH_BYTES:
        raise ProtocolError("bad namespace")
    if not isinstance(hashes, list) or not isinstance(idents, list) or len(hashes) != len(idents):
        raise ProtocolError("hashes and idents must be lists of equal length")
    if len(hashes) > max_blocks:
        raise ProtocolError(f"at most {max_blocks} blocks per fetch")
    if any(not isinstance(h, bytes) or len(h) != HASH_BYTES for h in hashes) or any(
            not isinstance(i, bytes) for i in idents):
        raise ProtocolError("bad block hash or ident")
    timeout_ms = request.get("timeout_ms", 2000)
    if not isinstance(timeout_ms, int):
        raise ProtocolError("bad timeout_ms")
    return ns, hashes, idents, min(max(timeout_ms / 1000, 0.001), 60.0)


def parse_answer(header: object, hashes: list[bytes], idents: list[bytes],
                 max_block_bytes: int) -> tuple[list[list], int]:
    """The entries of an answer and how many of them match what was asked, in order.

    ProtocolError for a malformed answer; a refusal by the server is one too.
    """
    if not isinstance(header, dict) or header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("unsupported answer version")
    if header.get("error"):
        raise ProtocolError(f"refused: {header['error']}")
    entries = header.get("blocks")
    if not isinstance(entries, list) or len(entries) > len(hashes):
        raise ProtocolError("answer lists more blocks than asked for")
    num_valid = len(entries)
    for i, entry in enumerate(entries):
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[2], int)
                and 0 <= entry[2] <= max_block_bytes and isinstance(entry[3], int)):
            raise ProtocolError(f"malformed entry {i}")
        if num_valid == len(entries) and (entry[0] != hashes[i] or entry[1] != idents[i]):
            num_valid = i
    return entries, num_valid


def abort_endpoint(ep) -> None:
    """Close ``ep`` at once; UCX cancels what is still posted on it."""
    with contextlib.suppress(Exception):
        ep.abort(period=ABORT_PERIOD_NS, max_attempts=1)
