"""How much host memory the DRAM pool may take.

The pool is allocated, and every page faulted in, at start: a pool larger than the memory the
host (or the container's cgroup) can still give would push the machine into swap or the OOM
killer minutes later, so ``kvstore serve`` refuses it up front.

RLIMIT_MEMLOCK is no limit on the pool: the CPU path locks nothing, and CUDA pins without it
(measured on an H100, CuPy 14.2: ``cudaHostRegister`` and ``cudaHostAlloc`` of 1 GiB succeed under
a 64 KiB RLIMIT_MEMLOCK, and VmLck stays 0). It bounds ``mlock`` and RDMA memory registration.
"""

from __future__ import annotations

from pathlib import Path

from kvstore.sizes import format_bytes

_MEMINFO = Path("/proc/meminfo")
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2): no limit


def _cgroup_headroom(root: Path) -> tuple[int, str] | None:
    """(bytes the cgroup may still charge, which file said so), or None without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),  # v2
                                   ("memory/memory.limit_in_bytes",  # v1
                                    "memory/memory.usage_in_bytes")):
        limit = _read_int(root / limit_file)
        if limit is None or limit >= _NO_LIMIT:
            continue
        usage = _read_int(root / usage_file) or 0
        return max(limit - usage, 0), str(root / limit_file)
    return None


def available_bytes(meminfo: Path = _MEMINFO, cgroup_root: Path = _CGROUP_ROOT
                    ) -> tuple[int, str] | None:
    """The memory a new allocation can get (the smaller of MemAvailable and the cgroup's
    headroom) and where that number comes from; None when neither can be read."""
    candidates = []
    host = _meminfo_available(meminfo)
    if host is not None:
        candidates.append((host, f"MemAvailable in {meminfo}"))
    cgroup = _cgroup_headroom(cgroup_root)
    if cgroup is not None:
        candidates.append((cgroup[0], f"the cgroup limit {cgroup[1]} less its usage"))
    return min(candidates) if candidates else None


def check_pool_fits(dram_bytes: int, meminfo: Path = _MEMINFO,
                    cgroup_root: Path = _CGROUP_ROOT) -> None:
    """ValueError, saying how much there is, when a ``dram_bytes`` pool cannot be had."""
    available = available_bytes(meminfo, cgroup_root)
    if available is not None and dram_bytes > available[0]:
        raise ValueError(
            f"--dram {format_bytes(dram_bytes)} is more memory than this host can give: "
            f"{format_bytes(available[0])} available ({available[1]}); choose a smaller --dram")
