"""SocketAccess: who may use the daemon's socket. Its own user always; with ``--socket-group``,
also the processes of that group (vLLM run as another user, say), checked at every connection
by the peer's credentials, not only by the file's mode.

Without a group the socket's folder is 0700 and the socket 0600. With one, the folder is 0710
(the group may reach the socket, not list the folder) and the socket 0660, both the group's;
a peer is let in when its uid is the daemon's, or its primary or a supplementary group is the
one named (``SO_PEERCRED``, ``SO_PEERGROUPS``; where the kernel lacks the latter, the groups
in ``/proc/PID/status``).
"""

from __future__ import annotations

import grp
import socket
import struct
from dataclasses import dataclass

_UCRED = struct.Struct("3i")  # pid, uid, gid
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13
_MAX_GROUPS = 1024


@dataclass(frozen=True)
class SocketAccess:
    """The group (gid) whose processes may connect beside the daemon's own user (None: nobody
    else); the daemon checks its own uid itself."""

    group_id: int | None = None

    @classmethod
    def of(cls, group: str | None = None) -> SocketAccess:
        """This process's access, with ``group`` (a name or a number) let in; ValueError for a
        group the system does not know."""
        if group is None:
            return cls()
        try:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        except KeyError:
            raise ValueError(f"--socket-group {group!r}: no such group") from None
        return cls(gid)

    @property
    def dir_mode(self) -> int:
        return 0o700 if self.group_id is None else 0o710

    @property
    def socket_mode(self) -> int:
        return 0o600 if self.group_id is None else 0o660

    def admits_group(self, sock: socket.socket) -> bool:
        """Whether the peer of ``sock`` is a process of the group (False without one)."""
        if self.group_id is None:
            return False
        credentials = peer_credentials(sock)
        if credentials is None:
            return False
        pid, _, gid = credentials
        return gid == self.group_id or self.group_id in _peer_groups(sock, pid)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of the process at the other end of the Unix socket ``sock``, as this
    process's namespaces see it (pid 0: not visible here), or None if they cannot be read."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except (OSError, AttributeError):
        return None
    return _UCRED.unpack(raw)


def _peer_groups(sock: socket.socket, pid: int) -> set[int]:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * _MAX_GROUPS)
        return set(struct.unpack(f"{len(raw) // 4}I", raw[:len(raw) // 4 * 4]))
    except OSError:
        pass
    try:  # an older kernel: the groups the process has now
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()
