"""Which network devices UCX may use, so that it listens only where ``--listen`` says.

Besides the listener of ``--listen``, UCX's TCP transport opens a listening socket on every
network device it uses (the data lanes peers connect to after the handshake). A daemon told to
listen on one address gets ``UCX_NET_DEVICES`` set to that address's device (plus the RDMA
devices, which open no TCP port) before UCX starts. An operator's own ``UCX_NET_DEVICES`` wins;
a wildcard or unresolvable address leaves UCX's defaults.

Not covered: ucxx binds the ``--listen`` listener itself on every interface (its listener takes
a port, not an address), so that one port stays open on all of them: firewall it.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from pathlib import Path

log = logging.getLogger(__name__)

_SYS_NET = Path("/sys/class/net")
_SYS_IB = Path("/sys/class/infiniband")
_SIOCGIFADDR = 0x8915
_IFF_LOOPBACK = 0x8


def _resolve(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
    except (OSError, IndexError, ValueError):
        return None


def _ipv4_address(ifname: str) -> ipaddress.IPv4Address | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()))
        except OSError:
            return None
    return ipaddress.IPv4Address(packed[20:24])


def _ipv6_devices(address: ipaddress.IPv6Address) -> list[str]:
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return []
    return [fields[5] for fields in map(str.split, lines)
            if len(fields) == 6 and fields[0] == address.exploded.replace(":", "")]


def _is_loopback_device(ifname: str) -> bool:
    try:
        return int((_SYS_NET / ifname / "flags").read_text(), 16) & _IFF_LOOPBACK != 0
    except (OSError, ValueError):
        return ifname == "lo"


def device_of(host: str) -> str | None:
    """The network device holding ``host``'s address; None for a wildcard or an unknown one."""
    address = _resolve(host)
    if address is None or address.is_unspecified:
        return None
    names = sorted(name for _, name in socket.if_nameindex())
    if address.is_loopback:
        return next((n for n in names if _is_loopback_device(n)), None)
    if isinstance(address, ipaddress.IPv6Address):
        found = _ipv6_devices(address)
        return found[0] if found else None
    return next((n for n in names if _ipv4_address(n) == address), None)


def _rdma_devices() -> list[str]:
    """``mlx5_0:1``-style names of the RDMA ports (they open no TCP listener)."""
    try:
        return sorted(f"{dev.name}:{port.name}" for dev in _SYS_IB.iterdir()
                      for port in (dev / "ports").iterdir())
    except OSError:
        return []


def restrict_to_listen_address(host: str) -> str | None:
    """Set ``UCX_NET_DEVICES`` to ``host``'s device (and the RDMA ports) unless it is set
    already; returns the value UCX will use, None where UCX keeps its defaults. Call before
    UCX starts in this process."""
    if "UCX_NET_DEVICES" in os.environ:
        return os.environ["UCX_NET_DEVICES"]
    device = device_of(host)
    if device is None:
        log.info("--listen %s: no single network device; UCX uses all of them", host)
        return None
    address = _resolve(host)
    rdma = [] if address is not None and address.is_loopback else _rdma_devices()
    value = ",".join([device, *rdma])
    os.environ["UCX_NET_DEVICES"] = value
    return value
