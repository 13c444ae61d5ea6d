"""PeerProcess: the process at the other end of a Unix socket, and whether it has exited.

A client may hold memory out of use because the daemon could still copy into it (a load that
went out and got no reply). Once the daemon's process has exited, nothing it mapped can be
written any more: the memory is the client's again. This watches that process through a pidfd
opened on the pid the kernel reports for the socket's peer (``SO_PEERCRED``), which cannot be
confused with a later process given the same pid.

Sound in both directions: a peer pid of 0 (the daemon in a pid namespace this process cannot
see), no pidfd support, or a pid already reused before the pidfd was opened make ``exited``
stay False: the caller waits as it would without the watch. ``exited`` never turns True while
the process that answered on the socket lives: the pidfd is opened before the connection's
first request, and a process that answered it was the one the pid named then.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import weakref

from kvstore.wire.socket_access import peer_credentials


class PeerProcess:
    """``exited``: the peer's process is gone (checked without blocking; stays True)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._exited = False
        self._fd: int | None = None
        if pid > 0 and hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):  # gone already, no permission, old kernel
                self._fd = os.pidfd_open(pid)
        # Closed once the exit is seen, or when the last holder lets go of this object.
        self._closer = weakref.finalize(self, _close, self._fd)

    @classmethod
    def of_socket(cls, sock: socket.socket) -> PeerProcess:
        """The process that made the listening end of the connected Unix socket ``sock``."""
        credentials = peer_credentials(sock)
        return cls(0 if credentials is None else credentials[0])

    @property
    def watched(self) -> bool:
        """Whether its exit can be seen at all (else ``exited`` stays False)."""
        return self._fd is not None or self._exited

    @property
    def exited(self) -> bool:
        if self._exited or self._fd is None:
            return self._exited
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        if poller.poll(0):  # a pidfd is readable once its process has exited
            self._exited = True
            self._closer()
            self._fd = None
        return self._exited


def _close(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
