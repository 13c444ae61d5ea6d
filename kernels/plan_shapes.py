"""PlanShapes: the keys of the cuDNN graphs an engine used, kept beside the plan cache, so the
next start loads every one of them before it says ready.

The warm-up builds the graphs of the shapes it runs; a long prefill's shapes (sequences, rows,
table width) are met only by requests, and each one's graph then comes in a request's path:
built by the background builder and loaded in line (``cudnn_background_load``), or loaded from
the disk cache in line on a later start (``cudnn_plan_load``): 5-40 ms a shape, 2-11 shapes a
run on an H200 (``first_use_builds`` of ``benchmarks/results/multiturn-agent-tools-h200-*``,
2026-11-30). With the shapes remembered, a warm restart loads them all before ``/ready``.

One file per scope, ``.shapes-<name>.json`` in the cache's directory (a dot name: not an entry
the cache trims), where the caller's name
digests the cuDNN setup and the engine's arena (a shape of one model is never preloaded for
another): a JSON list of keys (lists of scalars), oldest first, at most ``max_shapes``, written
to a temporary file and renamed into place (``plan_cache.write_atomically``). The file only
names entries to look up in the cache, whose blobs are verified when loaded; a file that does
not parse, or holds anything but such keys, is ignored and rewritten (logged once).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

from kernels.plan_cache import write_atomically

log = logging.getLogger("kernels.plan_cache")

MAX_SHAPES = 256  # as many graphs as CudnnPlans keeps in memory
MAX_FILE_BYTES = 1 << 20
_SCALARS = (bool, int, float, str)


def key_from_json(value: object) -> tuple | None:
    """A key as CudnnPlans makes them (nested tuples of scalars) from its JSON form; None if
    ``value`` is not one."""
    if isinstance(value, _SCALARS):
        return value  # type: ignore[return-value]
    if not isinstance(value, list) or len(value) > 32:
        return None
    items = [key_from_json(v) for v in value]
    return None if any(i is None for i in items) else tuple(items)


class PlanShapes:
    """The remembered keys of one scope; the disk is touched on ``load`` and on ``add`` of a key
    not yet known. Never raises for a disk problem (a failed write is logged; serving goes on).
    Thread-safety: the caller's (CudnnPlans runs on the step thread)."""

    def __init__(self, directory: Path, name: str, max_shapes: int = MAX_SHAPES) -> None:
        self.path = Path(directory) / f".shapes-{name}.json"
        self.max_shapes = max_shapes
        self._keys: list[tuple] = []
        self._known: set[tuple] = set()
        self.write_failures = 0

    def load(self) -> list[tuple]:
        """The keys on disk, oldest first (none when the file is absent or not valid)."""
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            data = b"[]"
        except OSError as exc:
            log.warning("cuDNN plan shapes: cannot read %s: %s", self.path, exc)
            data = b"[]"
        keys = None
        if len(data) <= MAX_FILE_BYTES:
            with contextlib.suppress(ValueError, RecursionError):  # RecursionError: nesting
                raw = json.loads(data)
                keys = [key_from_json(k) for k in raw] if isinstance(raw, list) else None
        if keys is None or any(not isinstance(k, tuple) for k in keys):
            log.warning("cuDNN plan shapes: %s is not a list of keys; it is ignored", self.path)
            keys = []
        self._keys = keys[-self.max_shapes:]
        self._known = set(self._keys)
        return list(self._keys)

    def add(self, key: tuple) -> bool:
        """Remember ``key`` (the oldest goes past ``max_shapes``); True if the file was written."""
        if key in self._known:
            return False
        self._keys.append(key)
        self._known.add(key)
        if len(self._keys) > self.max_shapes:
            self._known.discard(self._keys.pop(0))
        return self._write()

    def _write(self) -> bool:
        try:
            write_atomically(self.path, json.dumps(self._keys, separators=(",", ":")).encode())
            return True
        except (OSError, TypeError, ValueError) as exc:  # a full disk, an unstorable key
            self.write_failures += 1
            log.warning("cuDNN plan shapes: cannot write %s: %s", self.path, exc)
            return False
