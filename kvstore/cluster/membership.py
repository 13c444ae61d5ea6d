"""This node's view of the cluster's live nodes, and reading index entries against it.

An index entry names holders as "node_id/incarnation"; only holders that are live with the same
incarnation in the view (refreshed at every heartbeat) count. Parsed entries are cached per view.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

_PARSED_CACHE_MAX = 4096


class Holder(NamedTuple):
    """A live node that claims a block: its id, its current incarnation and where to reach it."""

    node_id: str
    incarnation: str
    addr: str


def parse_members(node_ids: Sequence[bytes], values: Sequence[bytes | None]) -> dict[bytes, Holder]:
    """The live nodes from their node keys' values (``"<incarnation> <host:port>"``, or None
    once expired), by "node_id/incarnation"."""
    members: dict[bytes, Holder] = {}
    for node_id, value in zip(node_ids, values):
        if value is None:
            continue  # expired: dead, or not yet back
        inc, _, addr = value.decode().partition(" ")
        members[node_id + b"/" + inc.encode()] = Holder(node_id.decode(), inc, addr)
    return members


class Membership:
    """The live nodes as of the last heartbeat (this one too). Replaced whole by ``update``;
    ``parse`` reads one consistent view without a lock."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._members: dict[bytes, Holder] = {}  # "node_id/incarnation" → live node
        self._parsed: dict[bytes, list[Holder]] = {}  # index value → live holders; per view

    def update(self, members: dict[bytes, Holder]) -> None:
        if members != self._members:
            self._members = members
            self._parsed = {}

    def live_nodes(self) -> dict[str, Holder]:
        return {m.node_id: m for m in self._members.values()}

    def __len__(self) -> int:
        return len(self._members)

    def parse(self, namespace: bytes, chunk: Sequence[bytes],
              raw: bytes) -> tuple[list[list[Holder]], list[tuple[bytes, bytes]]]:
        """The live holders (this node excluded) of each block of ``chunk`` from the lookup
        script's reply, up to the first block with none; and the (key, entry) pairs that look
        stale (dead nodes, older incarnations)."""
        if not raw:
            return [], []
        parsed, members = self._parsed, self._members
        out: list[list[Holder]] = []
        stale: list[tuple[bytes, bytes]] = []
        for h, value in zip(chunk, raw.split(b"\n")):
            holders = parsed.get(value)
            if holders is None:
                holders = []
                for entry in value.split(b" "):
                    member = members.get(entry)
                    if member is None:
                        stale.append((namespace + h, entry))
                    elif member.node_id != self.node_id:
                        holders.append(member)
                if not stale and len(parsed) < _PARSED_CACHE_MAX:
                    parsed[value] = holders
            if not holders:
                break
            out.append(holders)
        return out, stale
