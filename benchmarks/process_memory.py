"""Memory of the processes under test, for a before/after comparison: host memory from /proc,
GPU memory from nvidia-smi (per process and per device).

Host: ``rss_bytes`` (VmRSS), ``anon_bytes`` (RssAnon: heaps, and the daemon's DRAM pool, which
is faulted in at start), ``shmem_bytes`` (RssShmem), and ``engine_arena_bytes``: the size of
every engine KV arena (``memfd:kvengine-arena``) the process maps. The daemon maps each
registered engine's arena; one it still maps after that engine died is memory nobody frees.
GPU: ``gpu_bytes`` per process (nvidia-smi --query-compute-apps; None where nvidia-smi does not
list the pid, as in some containers) and every device's ``memory.used``, which also counts
memory a dead engine left behind in the daemon's CUDA IPC mappings.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

_STATUS_FIELDS = {"VmRSS": "rss_bytes", "RssAnon": "anon_bytes", "RssShmem": "shmem_bytes"}
ARENA_NAME = "memfd:kvengine-arena"


def host_memory(pid: int) -> dict[str, int]:
    """Resident memory of ``pid`` by kind, and the engine arenas it maps (bytes)."""
    out = {name: 0 for name in _STATUS_FIELDS.values()}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in _STATUS_FIELDS:
            out[_STATUS_FIELDS[key]] = int(value.split()[0]) * 1024
    arenas = 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if ARENA_NAME in line:
            start, end = line.split(None, 1)[0].split("-")
            arenas += int(end, 16) - int(start, 16)
    out["engine_arena_bytes"] = arenas
    return out


def _nvidia_smi(*query: str) -> list[list[str]] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        text = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [[x.strip() for x in line.split(",")] for line in text.splitlines() if line.strip()]


def gpu_memory() -> tuple[dict[int, int], list[int]] | None:
    """(GPU bytes by pid, bytes used on each device); None without nvidia-smi."""
    apps = _nvidia_smi("--query-compute-apps=pid,used_memory")
    devices = _nvidia_smi("--query-gpu=memory.used")
    if apps is None or devices is None:
        return None
    by_pid: dict[int, int] = {}
    for row in apps:
        if len(row) == 2 and row[0].isdigit() and row[1].isdigit():
            by_pid[int(row[0])] = by_pid.get(int(row[0]), 0) + int(row[1]) * 2**20
    return by_pid, [int(row[0]) * 2**20 for row in devices if row and row[0].isdigit()]


def snapshot(pids: dict[str, int], gpu: bool) -> dict:
    """Memory of each role's process (``{role: {pid, host..., gpu_bytes}}``) and, with ``gpu``,
    ``device_used_bytes`` (one figure per device)."""
    out: dict = {"processes": {}}
    readings = gpu_memory() if gpu else None
    for role, pid in pids.items():
        entry: dict = {"pid": pid, **host_memory(pid)}
        if gpu:
            entry["gpu_bytes"] = None if readings is None else readings[0].get(pid)
        out["processes"][role] = entry
    if gpu:
        out["device_used_bytes"] = None if readings is None else readings[1]
    return out
