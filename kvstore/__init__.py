"""kvstore: a tiered KV-cache block store (HBM, DRAM, SSD, peers) run as a sidecar daemon."""

from __future__ import annotations

from kvstore.keys import ModelIdentity, Namespace, block_hash, block_hashes

__all__ = ["ModelIdentity", "Namespace", "block_hash", "block_hashes", "Client"]


def __getattr__(name: str):
    # The client pulls in msgpack and sockets; importing keys alone should stay light.
    if name == "Client":
        from kvstore.client import Client

        return Client
    raise AttributeError(name)
