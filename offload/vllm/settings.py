"""The connector's settings, read once from vLLM's ``kv_connector_extra_config``."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from offload.vllm.lmcache_keys import lmcache_name, lmcache_variables_note, take_lmcache

log = logging.getLogger("offload.vllm")


@dataclass(frozen=True)
class ConnectorSettings:
    """Every knob, with its key in ``kv_connector_extra_config`` (the field name)."""

    kv_store_socket: str | None = None  # None: $KVSTORE_SOCKET or the daemon's default path
    lookup_timeout_s: float = 1.0  # the scheduler waits this long for a lookup, then recomputes
    load_timeout_s: float = 10.0  # a load's whole life: lookup, staging room, copy
    save_timeout_s: float = 10.0
    retry_interval_s: float = 2.0  # a lost connection is tried again at most this often
    register_timeout_s: float = 30.0  # a (re)registration's deadline; made off vLLM's steps
    load_blocks: int = 64  # staging room for loads (CPU) and the budget of blocks loading
    save_blocks: int = 64  # staging room for saves (CPU); a save that does not fit is skipped

    def __post_init__(self) -> None:
        for f in ("lookup_timeout_s", "load_timeout_s", "save_timeout_s", "retry_interval_s",
                  "register_timeout_s"):
            if not getattr(self, f) > 0:
                raise ValueError(f"kv_connector_extra_config.{f} must be positive")
        for f in ("load_blocks", "save_blocks"):
            if not getattr(self, f) > 0:
                raise ValueError(f"kv_connector_extra_config.{f} must be a positive integer")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None,
                          env: Mapping[str, str] | None = None) -> ConnectorSettings:
        """Known keys only: a typo is an error, not a silently ignored setting. LMCache's
        (``lmcache.<name>`` or the bare name) are taken where they have a direct equivalent
        and refused with the equivalent named otherwise (``lmcache_keys.py``); ``LMCACHE_*``
        variables of ``env`` (default: this process's) are named in one warning."""
        note = lmcache_variables_note(os.environ if env is None else env)
        if note is not None:
            log.warning("%s", note)
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        for key in [k for k in extra if k not in known and lmcache_name(k) is not None]:
            value = extra.pop(key)
            taken = take_lmcache(key, value)
            if taken is None:
                log.info("kvstore connector: LMCache's %s = %r asks for nothing kvstore does "
                         "not do: accepted", key, value)
            else:
                if taken[0] in extra:
                    raise ValueError(f"kv_connector_extra_config: {key} and {taken[0]} are one "
                                     "setting: give one")
                extra[taken[0]] = taken[1]
                log.info("kvstore connector: LMCache's %s taken as %s = %r", key, *taken)
        unknown = sorted(k for k in extra if k not in known)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; known: "
                             f"{sorted(known)}")
        values: dict[str, Any] = {}
        for key, value in extra.items():
            kind = known[key].type
            try:
                if key == "kv_store_socket":
                    values[key] = None if value in (None, "") else str(value)
                elif "int" in str(kind):
                    if isinstance(value, bool) or int(value) != value:
                        raise ValueError
                    values[key] = int(value)
                else:
                    values[key] = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"kv_connector_extra_config.{key}: bad value {value!r}") \
                    from None
        return cls(**values)
