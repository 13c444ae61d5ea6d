"""kvstore: a tiered KV-cache block store (HBM, DRAM, SSD, peers) run as a sidecar daemon."""

from __future__ import annotations

from kvstore.keys import ModelIdentity, Namespace, block_hash, block_hashes

__all__ = ["ModelIdentity", "Namespace", "block_hash", "block_hashes", "Client", "ClientError",
           "DaemonUnavailable", "Pending"]


def __getattr__(name: str):
    # The client pulls in msgpack and sockets; importing keys alone should stay light.
    if name == "Client":
        from kvstore.client import Client

        return Client
    if name == "ClientError":
        from kvstore.client import ClientError

        return ClientError
    if name == "DaemonUnavailable":
        from kvstore.client import DaemonUnavailable

        return DaemonUnavailable
    if name == "Pending":
        from kvstore.client import Pending

        return Pending
    raise AttributeError(name)
