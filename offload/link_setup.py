"""LinkSetup: what a new connection to the daemon does before it carries an engine's requests.

Run by the link's thread (``LinkThread``) after the daemon answered its first probe: the
registration of the engine's KV memory (a fixed ``KVLayout``, a fresh one made per connect, or
none), then the daemon's key filter, mapped when its hello names an authoritative one this
process can read. Every wait on the daemon is bounded by the request's own deadline and sliced,
so a link that is closing is never held up by a daemon that does not answer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable

from kvstore import Client, ClientError, KeyFilterView, Pending
from offload.vocab import KVLayout

log = logging.getLogger("offload")

# A wait on the daemon looks up from its reply this often (closing, the deadline).
WAIT_SLICE_S = 0.05


class LinkSetup:
    """One engine's registration and key filter, made again on every connect."""

    def __init__(self, layout: KVLayout | Callable[[], KVLayout] | None, engine_id: str,
                 register_timeout_s: float, counters: Counter[str], closing: threading.Event,
                 on_registered: Callable[[], None] | None = None) -> None:
        """``closing``: set once the link closes (waits give up); ``on_registered`` runs once
        each registration has been answered or given up."""
        self.layout = layout
        self.engine_id = engine_id
        self.register_timeout_s = register_timeout_s
        self.counters = counters
        self.closing = closing
        self.on_registered = on_registered

    def register(self, client: Client) -> int | None:
        """Register the layout (a fresh one if it is made per connect); its registration id,
        or None without a layout. Raises what the daemon or the socket raised."""
        if self.layout is None:
            return None
        layout = self.layout() if callable(self.layout) else self.layout
        # Fresh duplicates of the memory's descriptors for each registration: what goes out is
        # held open by this send alone, whatever the memory's owner does meanwhile.
        fds: list[int] = []
        try:
            for fd in layout.fds:
                fds.append(os.dup(fd))
            pending = client.register_async(layout, self.engine_id, self.register_timeout_s,
                                            fds=fds)
            for fd in fds:  # sent: the daemon holds its own copies
                os.close(fd)
            fds.clear()
            return self.wait(pending, self.register_timeout_s)
        finally:
            for fd in fds:
                os.close(fd)
            if self.on_registered is not None:
                self.on_registered()

    def open_key_filter(self, client: Client) -> KeyFilterView | None:
        """The daemon's key filter (named by its hello) if authoritative and readable here;
        else None (counted): lookups go out as before."""
        info = client.key_filter_info
        if info is None or not info["authoritative"]:
            return None
        try:
            view = KeyFilterView(info["path"], info["nonce"])
        except (OSError, ValueError) as exc:
            self.counters["key_filter_unusable"] += 1
            if self.counters["key_filter_unusable"] == 1:
                log.warning("kv offload: the store's key filter cannot be read (%s); every "
                            "prefix is looked up", exc)
            return None
        self.counters["key_filter_mapped"] += 1
        return view

    def wait(self, pending: Pending, timeout_s: float) -> int:
        """The reply, waited for in slices so that closing is not held up (bounded by the
        request's own deadline)."""
        deadline = time.monotonic() + timeout_s + 1.0
        while True:
            try:
                return pending.wait(WAIT_SLICE_S)
            except ClientError:
                if pending.poll():
                    raise  # the daemon's own error reply
                if self.closing.is_set() or time.monotonic() >= deadline:
                    raise
