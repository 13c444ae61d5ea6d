"""Peer block transfer over UCX: the client that fetches, the server that serves, their protocol."""
