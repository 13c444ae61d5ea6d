"""The connector's settings, read once from vLLM's ``kv_connector_extra_config``.

``check_extra_config`` is what vLLM's config creation runs (``offload/vllm/config_check.py``):
a bad key fails there, before any model loads, as one ``SettingsError`` line naming the key and
the fix. The connector's constructor reads the same settings again with ``from_extra_config``,
which also logs the notes (LMCache keys taken or accepted, ``LMCACHE_*`` variables).
"""

from __future__ import annotations

import difflib
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from offload.vllm.lmcache_keys import lmcache_name, lmcache_variables_note, take_lmcache

log = logging.getLogger("offload.vllm")

KEY = "kv_connector_extra_config"
DOCS = "docs/vllm.md"
# Integer keys where 0 turns the thing off (the others must be positive).
_ZERO_IS_OFF = frozenset({"device_staging_blocks"})
MAX_SOCKET_PATH_BYTES = 107  # sun_path is 108 bytes on Linux, its terminating NUL included


class SettingsError(ValueError):
    """A setting the connector refuses: one line, naming the key and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__("kvstore connector: " + " ".join(message.split()))


@dataclass(frozen=True)
class ConnectorSettings:
    """Every knob, with its key in ``kv_connector_extra_config`` (the field name)."""

    kv_store_socket: str | None = None  # None: $KVSTORE_SOCKET or the daemon's default path
    lookup_timeout_s: float = 1.0  # the scheduler waits this long for a lookup, then recomputes
    load_timeout_s: float = 10.0  # a load's whole life: lookup, staging room, copy
    save_timeout_s: float = 10.0
    retry_interval_s: float = 2.0  # a lost connection is tried again at most this often
    register_timeout_s: float = 30.0  # a (re)registration's deadline; made off vLLM's steps
    load_blocks: int = 64  # staging room for loads and the budget of blocks loading
    save_blocks: int = 64  # staging room for saves; a save waits for room (save_timeout_s)
    # GPU: whole-block slots of staging in device memory. The worker packs a save's pieces into
    # slots on a stream of its own and the daemon moves whole blocks; a load lands in slots and
    # is scattered. None: load_blocks + save_blocks slots on a GPU where the packing's modules
    # import and that is at most 1 GiB, else none; 0: none (the daemon reads and writes the
    # engine's pieces in place); N: N slots, load_blocks of them for loads, the rest for saves
    # (offload/vllm/staging_room.py).
    device_staging_blocks: int | None = None

    def __post_init__(self) -> None:
        for f in ("lookup_timeout_s", "load_timeout_s", "save_timeout_s", "retry_interval_s",
                  "register_timeout_s"):
            if not getattr(self, f) > 0:
                raise SettingsError(f"{KEY}.{f} must be a positive number of seconds, got "
                                    f"{getattr(self, f)!r}")
        for f in ("load_blocks", "save_blocks"):
            if not getattr(self, f) > 0:
                raise SettingsError(f"{KEY}.{f} must be a positive integer, got "
                                    f"{getattr(self, f)!r}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None,
                          env: Mapping[str, str] | None = None) -> ConnectorSettings:
        """Known keys only: a typo is an error, not a silently ignored setting. LMCache's
        (``lmcache.<name>`` or the bare name) are taken where they have a direct equivalent,
        accepted where they ask for nothing (off, or LMCache's default), and refused with the
        equivalent named otherwise (``lmcache_keys.py``); each is noted in the log.
        ``LMCACHE_*`` variables of ``env`` (default: this process's) are named in one warning.
        Raises ``SettingsError``."""
        note = lmcache_variables_note(os.environ if env is None else env)
        if note is not None:
            log.warning("%s", note)
        settings, notes = _read(extra)
        for line in notes:
            log.info("%s", line)
        return settings


def check_extra_config(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    """``extra`` read as the connector will read it, logging nothing: the check vLLM's config
    creation runs. Raises ``SettingsError`` (one line: the key and the fix)."""
    return _read(extra)[0]


def _read(extra: Mapping[str, Any] | None) -> tuple[ConnectorSettings, list[str]]:
    """The settings ``extra`` gives, and one note per LMCache key taken or accepted."""
    if extra is not None and not isinstance(extra, Mapping):
        raise SettingsError(f"{KEY} must be a JSON object, got {extra!r}")
    extra = dict(extra or {})
    known = {f.name: f for f in fields(ConnectorSettings)}
    notes: list[str] = []
    given = {}  # this connector's key -> the LMCache key its value came from
    for key in [k for k in extra if k not in known and lmcache_name(str(k)) is not None]:
        value = extra.pop(key)
        try:
            taken = take_lmcache(key, value)
        except ValueError as exc:
            raise SettingsError(f"{exc}; remove {key}") from None
        if taken is None:
            notes.append(f"kvstore connector: LMCache's {key} = {value!r} asks for nothing "
                         "kvstore does not do: accepted")
            continue
        if taken[0] in extra:
            raise SettingsError(f"{KEY}: {key} and {taken[0]} are one setting: give one")
        extra[taken[0]] = taken[1]
        given[taken[0]] = f"{key} (as {taken[0]})"
        notes.append(f"kvstore connector: LMCache's {key} taken as {taken[0]} = {taken[1]!r}")
    unknown = sorted(str(k) for k in extra if k not in known)
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        more = f" (and {unknown[1:]})" if len(unknown) > 1 else ""
        raise SettingsError(f"{KEY} has an unknown key {key!r}{more}: {hint}the keys are "
                            f"{', '.join(sorted(known))} ({DOCS})")
    values = {key: _value(given.get(key, key), value, known[key].type)
              for key, value in extra.items()}
    if values.get("kv_store_socket") is not None:
        _check_socket_path(values["kv_store_socket"])
    return ConnectorSettings(**values), notes


def _value(key: str, value: Any, kind: Any) -> Any:
    """``value`` as a field of type ``kind`` takes it; SettingsError naming ``key`` (the key
    as given) if it cannot."""
    if key == "kv_store_socket":
        if value in (None, ""):
            return None
        if not isinstance(value, str):
            raise SettingsError(f"{KEY}.{key} must be a path (a string), got {value!r}")
        return value
    if "int" in str(kind):
        least = 0 if key in _ZERO_IS_OFF else 1
        wanted = f"{KEY}.{key} must be a {'non-negative' if least == 0 else 'positive'} " \
                 f"integer{' (0: off)' if least == 0 else ''}, got {value!r}"
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise SettingsError(wanted)
        try:
            number = float(value)
            if number != int(number) or number < least:
                raise ValueError
        except (TypeError, ValueError, OverflowError):
            raise SettingsError(wanted) from None
        return int(number)
    seconds = f"{KEY}.{key} must be a positive number of seconds, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SettingsError(seconds)
    try:
        number = float(value)
    except ValueError:
        raise SettingsError(seconds) from None
    if not number > 0:  # NaN included
        raise SettingsError(seconds)
    return number


def _check_socket_path(path: str) -> None:
    """Refuse a socket path no daemon can ever listen on. A path with nothing there yet is
    fine: the daemon may come up after vLLM (vLLM recomputes until it does)."""
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise SettingsError(f"{KEY}.kv_store_socket is {len(os.fsencode(path))} bytes, longer "
                            f"than a Unix socket path can be ({MAX_SOCKET_PATH_BYTES}): start "
                            f"the daemon with a shorter --socket and name that one")
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if stat.S_ISDIR(mode):
        raise SettingsError(f"{KEY}.kv_store_socket {path!r} is a folder: name the socket in "
                            f"it (kvstore serve --socket prints the path, e.g. "
                            f"{os.path.join(path, 'kvstore.sock')!r})")
    if not stat.S_ISSOCK(mode):
        raise SettingsError(f"{KEY}.kv_store_socket {path!r} is not a socket: name the path "
                            f"kvstore serve --socket listens on")
