"""Sharing blocks across daemons: the Redis index, this node, peers over UCX."""
