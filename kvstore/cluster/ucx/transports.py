"""Which UCX transports an endpoint uses: ``ucp_ep_query`` through ctypes on the libucp ucxx loaded.

UCX picks its transports per endpoint (tcp, shared memory, cuda_ipc, RDMA ...) and ucxx does not
say which. UCX 1.14 added ``UCP_EP_ATTR_FIELD_TRANSPORTS`` to ``ucp_ep_query``: one (transport,
device) pair per lane of the endpoint. A lane with no device is the connection manager's (the
sockaddr handshake), named ``cm:NAME`` here; every other lane is ``TRANSPORT/DEVICE``.

The struct layouts below are UCX's ``ucp.h``/``ucp_def.h`` (1.14 to 1.21): ``ucp_ep_attr_t`` is
field_mask, name[32], two ``sockaddr_storage`` (128 bytes, 8-aligned), ``ucp_transports_t``,
user_data. Where libucp is older, missing or not loaded, the answer is None ("unknown"), never
an exception.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

_EP_ATTR_FIELD_TRANSPORTS = 1 << 3
_ENTITY_NAME_MAX = 32
_MAX_LANES = 64  # UCP_MAX_LANES is 16 in UCX 1.21: room to spare
_MIN_VERSION = (1, 14)


class _TransportEntry(ctypes.Structure):
    _fields_ = [("transport_name", ctypes.c_char_p), ("device_name", ctypes.c_char_p)]


class _Transports(ctypes.Structure):
    _fields_ = [("entries", ctypes.POINTER(_TransportEntry)), ("num_entries", ctypes.c_uint),
                ("entry_size", ctypes.c_size_t)]


class _EpAttr(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64), ("name", ctypes.c_char * _ENTITY_NAME_MAX),
                ("local_sockaddr", ctypes.c_uint64 * 16), ("remote_sockaddr", ctypes.c_uint64 * 16),
                ("transports", _Transports), ("user_data", ctypes.c_void_p)]


def loaded_libucp() -> str | None:
    """The path of the libucp this process has mapped (ucxx's), None before ucxx loaded it."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)  # address, perms, offset, dev, inode, path
        if len(fields) == 6 and "/libucp.so" in fields[5]:
            return fields[5].strip()
    return None


@functools.cache
def _ep_query() -> Callable | None:
    """``ucp_ep_query`` of the loaded libucp, when it knows the transports field; else None.
    Cached once found: the library stays mapped for the life of the process."""
    path = loaded_libucp()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        lib.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
        if (major.value, minor.value) < _MIN_VERSION:
            log.info("UCX %d.%d cannot tell an endpoint's transports (needs 1.14)",
                     major.value, minor.value)
            return None
        query = lib.ucp_ep_query
    except (OSError, AttributeError) as exc:
        log.info("cannot query UCX endpoints through %s: %s", path, exc)
        return None
    query.argtypes = [ctypes.c_void_p, ctypes.POINTER(_EpAttr)]
    query.restype = ctypes.c_int
    return query


def _ucp_ep_handle(ep) -> int | None:
    """The ``ucp_ep_h`` of a ucxx endpoint (async or core), None if it has none (closed)."""
    for name in ("ucp_endpoint", "handle"):
        try:
            handle = getattr(ep, name)
        except Exception:  # ucxx raises when the endpoint is closed
            return None
        if isinstance(handle, int):
            return handle or None
    return None


def endpoint_transports(ep) -> list[str] | None:
    """The lanes of a live ucxx endpoint, e.g. ``["cm:tcp", "tcp/lo"]``; None when unknown.

    Call it on the thread that runs the endpoint's UCX calls, while the endpoint is open (UCX
    reads the endpoint's configuration without a lock).
    """
    query = _ep_query()
    handle = _ucp_ep_handle(ep)
    if query is None or handle is None:
        return None
    entries = (_TransportEntry * _MAX_LANES)()
    attr = _EpAttr(field_mask=_EP_ATTR_FIELD_TRANSPORTS)
    attr.transports.entries = entries
    attr.transports.num_entries = _MAX_LANES
    attr.transports.entry_size = ctypes.sizeof(_TransportEntry)
    if query(handle, ctypes.byref(attr)) != 0:  # UCS_OK
        return None
    lanes: list[str] = []
    for entry in entries[:min(attr.transports.num_entries, _MAX_LANES)]:
        if not entry.transport_name:
            continue
        name = entry.transport_name.decode(errors="replace")
        device = (entry.device_name or b"").decode(errors="replace")
        lanes.append(f"{name}/{device}" if device else f"cm:{name}")
    return lanes or None


def data_transports(lanes: list[str] | None) -> list[str]:
    """The distinct ``TRANSPORT/DEVICE`` lanes that move data (the handshake's lane left out)."""
    return sorted({lane for lane in lanes or () if not lane.startswith("cm:")})
