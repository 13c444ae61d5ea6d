"""The first exchange of a connection: the client's ``hello`` (its protocol version) and how it
reads the answer. A daemon of another major refuses it with ``protocol_mismatch``; a daemon that
predates the handshake answers ``unknown_verb`` and speaks 1.0; either way a client of another
major than its daemon's gets one error that names both versions."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from kvstore.wire import protocol as proto
from kvstore.wire.replies import ProtocolMismatch


@functools.cache
def package_version() -> str:
    """This client's distribution version, for the hello and its errors."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvstore-tiered")
    except PackageNotFoundError:
        return "unknown"


def hello_args() -> dict[str, Any]:
    return {"protocol": proto.PROTOCOL_VERSION,
            "client": f"kvstore-tiered client {package_version()}"}


def read_hello(reply: dict, socket_path: Path) -> tuple[str | None, ProtocolMismatch | None]:
    """(the daemon's protocol version, the mismatch to fail the connection with, if any)."""
    err = reply.get("error") or {}
    if err.get("code") == proto.PROTOCOL_MISMATCH:
        return None, ProtocolMismatch(str(err.get("message")))
    if reply.get("ok"):
        theirs = str((reply.get("result") or {}).get("protocol", ""))
    elif err.get("code") == proto.UNKNOWN_VERB:
        theirs = proto.PRE_HANDSHAKE_VERSION
    else:
        return None, None  # a hello the daemon could not answer: the requests will tell
    try:
        same = proto.protocol_major(theirs) == proto.protocol_major(proto.PROTOCOL_VERSION)
    except ValueError:
        same = False
    if same:
        return theirs, None
    return theirs, ProtocolMismatch(
        f"the kvstore daemon at {socket_path} speaks protocol {theirs[:32]!r}; this client "
        f"(kvstore-tiered {package_version()}) speaks {proto.PROTOCOL_VERSION}: upgrade the "
        f"older one (one major version on both sides)")


# How far the daemon's clock reading may fall outside our send and read of the hello and still be
# our clock (another clock, a time namespace's, is off by its boot time: seconds at least).
CLOCK_SLACK_S = 0.05


def same_clock(reply: dict, sent_at: float, read_at: float) -> bool:
    """Whether the hello's answer shows the daemon on our CLOCK_MONOTONIC: its reading (1.3)
    falls between when we sent the hello and when we read the answer."""
    mono = (reply.get("result") or {}).get("mono") if reply.get("ok") else None
    if type(mono) not in (int, float):
        return False
    return sent_at - CLOCK_SLACK_S <= mono <= read_at + CLOCK_SLACK_S


def key_filter_info(reply: dict) -> dict | None:
    """The hello's ``key_filter`` (1.5): ``{"path": str, "authoritative": bool, "nonce":
    int}``, or None when the daemon has none or the entry is malformed."""
    entry = (reply.get("result") or {}).get("key_filter") if reply.get("ok") else None
    if (not isinstance(entry, dict) or not isinstance(entry.get("path"), str)
            or not isinstance(entry.get("authoritative"), bool)
            or type(entry.get("nonce")) is not int):
        return None
    return {"path": entry["path"], "authoritative": entry["authoritative"],
            "nonce": entry["nonce"]}
