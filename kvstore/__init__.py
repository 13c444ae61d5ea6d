"""kvstore: a tiered KV-cache block store (HBM, DRAM, SSD, peers) run as a sidecar daemon."""

from __future__ import annotations

from typing import Any

from kvstore.keys import ModelIdentity, Namespace, block_hash, block_hashes
from kvstore.tiers import Tier

__all__ = [
    "ModelIdentity",
    "Namespace",
    "block_hash",
    "block_hashes",
    "Client",
    "ClientError",
    "DaemonUnavailable",
    "KeyFilterView",
    "LocateReply",
    "MAX_LOCATE_BLOCKS",
    "Pending",
    "PeerProcess",
    "StoreState",
    "Tier",
]

# The client pulls in msgpack and sockets; importing keys alone should stay light.
_CLIENT_NAMES = frozenset({"Client", "ClientError", "DaemonUnavailable", "LocateReply",
                           "Pending"})


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        from kvstore.wire import client

        return getattr(client, name)
    if name == "KeyFilterView":  # an engine's map of the daemon's key filter
        from kvstore.key_filter import KeyFilterView

        return KeyFilterView
    if name == "MAX_LOCATE_BLOCKS":  # the longest chain a client's ``locate`` may send
        from kvstore.wire.verbs import MAX_LOCATE_BLOCKS

        return MAX_LOCATE_BLOCKS
    if name == "PeerProcess":  # the daemon's process behind a client's socket: exited yet?
        from kvstore.wire import peer_process

        return peer_process.PeerProcess
    if name == "StoreState":  # the daemon's health as a client sees it
        from kvstore.wire import store_state

        return store_state.StoreState
    raise AttributeError(name)
