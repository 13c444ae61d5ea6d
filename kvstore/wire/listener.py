"""The daemon's listening Unix socket: a private 0700 directory, a 0600 socket, the peer's uid.

Only the daemon's own user may talk to it (and, with ``--socket-group``, that group's processes:
``SocketAccess``): the directory must be ours and closed to others, the socket file is 0600 (0660),
and every accepted peer's credentials are checked. A
socket file left by a dead daemon is replaced; one a live daemon answers on is not.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

from kvstore.wire.socket_access import SocketAccess, peer_credentials

# sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107


class SocketSetupError(Exception):
    """The socket cannot be placed where asked; the message says why and what to do."""


def prepare_socket_dir(directory: Path, access: SocketAccess | None = None) -> None:
    """Create ``directory`` 0700, or check an existing one is ours and not open to others;
    with a group in ``access``, the folder is the group's and 0710 (set on ours if it is not)."""
    access = access or SocketAccess.of()
    if not directory.exists() and not directory.is_symlink():
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            directory.mkdir(mode=0o700)
        except FileExistsError:
            pass  # a concurrent start made it; checked below like any existing directory
        except OSError as exc:
            raise SocketSetupError(f"cannot create socket directory {directory}: "
                                   f"{exc.strerror}") from None
    try:
        st = os.lstat(directory)
    except OSError as exc:
        raise SocketSetupError(f"cannot stat socket directory {directory}: "
                               f"{exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise SocketSetupError(f"socket directory {directory} is a symlink; refusing to use it")
    if not stat.S_ISDIR(st.st_mode):
        raise SocketSetupError(f"socket directory {directory} is not a directory")
    if st.st_uid != os.getuid():
        raise SocketSetupError(f"socket directory {directory} is owned by uid {st.st_uid}, not "
                               f"by this user (uid {os.getuid()}); refusing to use it")
    if access.group_id is not None:
        try:  # ours: made the group's, reachable (not listable) by it, closed to others
            os.chown(directory, -1, access.group_id)
            os.chmod(directory, access.dir_mode)
        except OSError as exc:
            raise SocketSetupError(f"cannot give socket directory {directory} to group "
                                   f"{access.group_id}: {exc.strerror}") from None
        return
    if st.st_mode & 0o077:
        raise SocketSetupError(f"socket directory {directory} has mode "
                               f"{stat.S_IMODE(st.st_mode):04o}; it must not be accessible to "
                               f"group or others (chmod 700 it or pick another --socket)")


def check_socket_path(path: Path, access: SocketAccess | None = None) -> None:
    """What ``bind_unix_socket`` will refuse, checked before anything costly is done (the
    daemon's DRAM pool is faulted in after this): the path's length, its directory (created
    0700 when missing) and a live daemon on it. SocketSetupError says why."""
    path = Path(os.path.abspath(path))
    if len(os.fsencode(str(path))) > MAX_SOCKET_PATH_BYTES:
        raise SocketSetupError(f"socket path {path} is longer than {MAX_SOCKET_PATH_BYTES} bytes")
    prepare_socket_dir(path.parent, access)
    _remove_stale_socket(path, remove=False)


def _remove_stale_socket(path: Path, remove: bool = True) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketSetupError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise SocketSetupError(f"cannot probe existing socket {path}: {exc}") from None
        if remove:
            path.unlink(missing_ok=True)  # nobody listens: a dead daemon's leftover
        return
    finally:
        probe.close()
    raise SocketSetupError(f"another daemon is already listening on {path}")


def bind_unix_socket(path: Path, backlog: int = 128,
                     access: SocketAccess | None = None) -> socket.socket:
    """A listening socket at ``path`` (0600, in a checked 0700 directory; with a group in
    ``access``, 0660 and the group's, in a 0710 one)."""
    access = access or SocketAccess.of()
    path = Path(os.path.abspath(path))
    if len(os.fsencode(str(path))) > MAX_SOCKET_PATH_BYTES:
        raise SocketSetupError(f"socket path {path} is longer than {MAX_SOCKET_PATH_BYTES} bytes")
    prepare_socket_dir(path.parent, access)
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # no window in which the socket exists with looser permissions
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise SocketSetupError(f"cannot bind {path}: {exc.strerror}") from None
    finally:
        os.umask(old_umask)
    if access.group_id is not None:
        os.chown(path, -1, access.group_id)
    os.chmod(path, access.socket_mode)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def socket_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the socket file, to unlink it at exit only if it is still ours."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def unlink_if_ours(path: Path, identity: tuple[int, int] | None) -> None:
    if identity is not None and socket_identity(path) == identity:
        Path(path).unlink(missing_ok=True)


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket, or None if it cannot be read."""
    credentials = peer_credentials(sock)
    return None if credentials is None else credentials[1]
