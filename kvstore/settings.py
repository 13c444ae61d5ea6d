"""Environment variables the project reads, read in this one place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvSettings:
    """Process-wide settings taken from the environment once, at first use."""

    socket_path: Path
    debug_hash_bits: int | None  # truncate block hashes to this many bits (collision tests only)
    # Tests only: SIGUSR2 blocks the daemon's control loop this long (a stand-in for a slow
    # synchronous call on the loop), so the health probes' view of a wedged loop can be tested.
    debug_stall_s: float | None = None
    # Tests only: the daemon maps this engine's CUDA regions at a wrong address, past the checks
    # (KVSTORE_DEBUG_CORRUPT_ENGINE), so a real sticky CUDA error can be forced on a GPU.
    debug_corrupt_engine: str | None = None
    # Diagnosis only (KVSTORE_DEBUG_STALL_STACKS=1): the daemon has every thread's stack written
    # to a file when its control loop stalls (``daemon.stalls``). Off by default: faulthandler's
    # watchdog reads the other threads' frames without the GIL, and a stall that ends during
    # the dump races it (CPython documents the dump as unsafe while other threads run).
    debug_stall_stacks: bool = False


def default_socket_path(env: dict[str, str] | None = None) -> Path:
    """$KVSTORE_SOCKET, else $XDG_RUNTIME_DIR/kvstore/kvstore.sock, else /tmp/kvstore-$UID/..."""
    env = os.environ if env is None else env
    if env.get("KVSTORE_SOCKET"):
        return Path(env["KVSTORE_SOCKET"])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "kvstore" / "kvstore.sock"
    return Path(f"/tmp/kvstore-{os.getuid()}") / "kvstore.sock"


def load_env_settings(env: dict[str, str] | None = None) -> EnvSettings:
    """Parse the environment; a malformed value raises ValueError naming the variable."""
    env = os.environ if env is None else env
    bits_text = env.get("KVSTORE_DEBUG_HASH_BITS", "").strip()
    debug_hash_bits = None
    if bits_text:
        try:
            debug_hash_bits = int(bits_text)
        except ValueError:
            msg = f"KVSTORE_DEBUG_HASH_BITS must be an integer, got {bits_text!r}"
            raise ValueError(msg) from None
        if not 1 <= debug_hash_bits <= 128:
            raise ValueError(f"KVSTORE_DEBUG_HASH_BITS must be in 1..128, got {debug_hash_bits}")
    stall_text = env.get("KVSTORE_DEBUG_STALL_ON_SIGUSR2", "").strip()
    debug_stall_s = None
    if stall_text:
        try:
            debug_stall_s = float(stall_text)
        except ValueError:
            debug_stall_s = -1.0
        if not 0 < debug_stall_s <= 600:
            raise ValueError(f"KVSTORE_DEBUG_STALL_ON_SIGUSR2 must be seconds in (0, 600], got "
                             f"{stall_text!r}")
    stacks_text = env.get("KVSTORE_DEBUG_STALL_STACKS", "").strip()
    if stacks_text not in ("", "0", "1"):
        raise ValueError(f"KVSTORE_DEBUG_STALL_STACKS must be 0 or 1, got {stacks_text!r}")
    return EnvSettings(socket_path=default_socket_path(env), debug_hash_bits=debug_hash_bits,
                       debug_stall_s=debug_stall_s,
                       debug_corrupt_engine=env.get("KVSTORE_DEBUG_CORRUPT_ENGINE") or None,
                       debug_stall_stacks=stacks_text == "1")
