"""forbid_inspection: this process closed to the other processes of its user.

A process that holds KV arenas (the daemon maps every registered engine's; a CPU engine's is a
``memfd``) would otherwise let any process of the same uid open them read-write through
``/proc/<pid>/fd/N``, or read its memory through ``/proc/<pid>/mem``. ``prctl(PR_SET_DUMPABLE,
0)`` makes those files root's: the same uid can no longer open them. What it costs: no core dump
is written when the process crashes, and debuggers and samplers (gdb, py-spy, ``perf`` with
stacks) cannot attach without root. ``--dumpable`` keeps both, for debugging. Linux only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

_PR_SET_DUMPABLE = 4
_PR_GET_DUMPABLE = 3


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _prctl(option: int, arg: int = 0) -> int:
    result = _libc().prctl(option, arg, 0, 0, 0)
    if result < 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")
    return result


def forbid_inspection() -> bool:
    """Make this process non-dumpable; False where the platform has no prctl (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    _prctl(_PR_SET_DUMPABLE, 0)
    return True


def is_dumpable() -> bool:
    """Whether this process may be inspected by its uid (always True off Linux)."""
    return not sys.platform.startswith("linux") or _prctl(_PR_GET_DUMPABLE) == 1
