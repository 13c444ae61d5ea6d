"""Memory of the processes under test, for a before/after comparison: host memory from /proc,
GPU memory from nvidia-smi (per process and per device).

Host: ``rss_bytes`` (VmRSS), ``anon_bytes`` (RssAnon: heaps, and the daemon's DRAM pool, which
is faulted in at start), ``shmem_bytes`` (RssShmem), and ``engine_arena_bytes``: the size of
every engine KV arena (``memfd:kvengine-arena``) the process maps. The daemon maps each
registered engine's arena; one it still maps after that engine died is memory nobody frees.
GPU: ``gpu_bytes`` per process (nvidia-smi --query-compute-apps; None where nvidia-smi does not
list the pid, as in some containers) and the ``memory.used`` of the devices the stack runs on,
which also counts memory a dead engine left behind in the daemon's CUDA IPC mappings. Only those
devices: nvidia-smi lists every GPU of the host whatever ``CUDA_VISIBLE_DEVICES`` says, and jobs
on the other GPUs (side by side on a four-GPU host) are not the stack's. Each device's compute
processes that are not the stack's are listed, so memory nobody under test holds is named.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
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


def host_device(ordinal: int, visible: str | None = None) -> str:
    """The nvidia-smi index or UUID of CUDA device ``ordinal`` of this process, through
    ``CUDA_VISIBLE_DEVICES`` (``visible``; from the environment when None)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if not visible:
        return str(ordinal)
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    if ordinal >= len(entries):
        raise ValueError(f"cuda:{ordinal} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    return entries[ordinal]


def gpu_memory() -> tuple[dict[int, int], list[dict]] | None:
    """(GPU bytes by pid, each device's ``index``, ``uuid``, ``used_bytes`` and compute
    ``pids``); None without nvidia-smi."""
    apps = _nvidia_smi("--query-compute-apps=pid,used_memory,gpu_uuid")
    devices = _nvidia_smi("--query-gpu=index,uuid,memory.used")
    if apps is None or devices is None:
        return None
    by_pid: dict[int, int] = {}
    pids_on: dict[str, list[int]] = {}
    for row in apps:
        if len(row) == 3 and row[0].isdigit() and row[1].isdigit():
            by_pid[int(row[0])] = by_pid.get(int(row[0]), 0) + int(row[1]) * 2**20
            pids_on.setdefault(row[2], []).append(int(row[0]))
    return by_pid, [{"index": row[0], "uuid": row[1], "used_bytes": int(row[2]) * 2**20,
                     "pids": pids_on.get(row[1], [])}
                    for row in devices if len(row) == 3 and row[2].isdigit()]


def snapshot(pids: dict[str, int], gpu: bool, ordinals: Sequence[int] = (0,)) -> dict:
    """Memory of each role's process (``{role: {pid, host..., gpu_bytes}}``) and, with ``gpu``,
    ``device_used_bytes`` (one figure per device of ``ordinals``, this process's CUDA device
    numbers) and ``devices`` (those devices, each with the compute pids not in ``pids``)."""
    out: dict = {"processes": {}}
    readings = gpu_memory() if gpu else None
    for role, pid in pids.items():
        entry: dict = {"pid": pid, **host_memory(pid)}
        if gpu:
            entry["gpu_bytes"] = None if readings is None else readings[0].get(pid)
        out["processes"][role] = entry
    if gpu:
        names = {host_device(o) for o in ordinals}
        mine = [d for d in readings[1] if d["index"] in names or d["uuid"] in names] \
            if readings is not None else None
        out["device_used_bytes"] = None if not mine else [d["used_bytes"] for d in mine]
        ours = set(pids.values())
        out["devices"] = None if mine is None else [
            {**d, "pids": [p for p in d["pids"] if p not in ours]} for d in mine]
    return out
