"""LMCache's settings as they arrive in ``kv_connector_extra_config`` (``lmcache.<name>`` or the
bare name, as LMCache's connector takes them), and where each one's job is done here.

A setting with a direct equivalent is taken (``lookup_timeout_ms``), and one whose value is what
kvstore always does is accepted as it is (``save_decode_cache: true``); so is one left at a value
that asks for nothing (off, empty, or LMCache's own default: ``enable_p2p: false``,
``remote_url: null``, ``cache_policy: LRU``), as a moved configuration often lists every key.
Any other is refused with the equivalent named, never ignored.
``docs/migrating-from-lmcache.md`` is the long form.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

PREFIX = "lmcache."
_DAEMON_DRAM = "the daemon's DRAM tier: kvstore serve --dram SIZE (e.g. 16Gi)"
_DAEMON_SSD = "the daemon's SSD tier: kvstore serve --ssd-dir DIR --ssd-size SIZE"
_CLUSTER = ("sharing between nodes: kvstore serve --cluster redis://HOST:PORT/DB on every node "
            "(Redis holds the index, blocks move daemon to daemon over UCX)")
_ROLES = ("prefill/decode hand-off: kv_role kv_producer (prefill) and kv_consumer (decode) on one "
          "daemon, or daemons in one --cluster")
_ADMIN = "the daemon's admin HTTP: kvstore serve --http HOST:PORT (/health, /stats, /metrics)"


@dataclass(frozen=True)
class LmcacheKey:
    """Where an LMCache setting's job is done here; ``take`` maps an accepted value to this
    connector's ``(key, value)`` (``None``: accepted, nothing to set) or raises ValueError."""

    equivalent: str
    take: Callable[[Any], tuple[str, Any] | None] | None = None


def _always(expected: bool, what: str) -> Callable[[Any], None]:
    def take(value: Any) -> None:
        if not isinstance(value, bool) and str(value).strip().lower() not in ("true", "false",
                                                                               "1", "0"):
            raise ValueError(f"expected true or false, got {value!r}")
        if (value is True or str(value).strip().lower() in ("true", "1")) != expected:
            raise ValueError(what)

    return take


def _milliseconds_to_lookup_timeout(value: Any) -> tuple[str, Any]:
    if isinstance(value, bool):
        raise ValueError(f"expected milliseconds, got {value!r}")
    return "lookup_timeout_s", float(value) / 1000.0


NONE = "no equivalent: "
SETTINGS: dict[str, LmcacheKey] = {
    "chunk_size": LmcacheKey("the store keeps whole vLLM blocks: vLLM's --block-size is the unit"),
    "local_cpu": LmcacheKey(_DAEMON_DRAM, _always(True, "the daemon's DRAM tier is always on")),
    "max_local_cpu_size": LmcacheKey(_DAEMON_DRAM),
    "reserve_local_cpu_size": LmcacheKey(_DAEMON_DRAM),
    "local_cpu_use_hugepages": LmcacheKey(NONE + "the daemon allocates and faults in its pool "
                                          "at start (pinned on a GPU machine)"),
    "local_disk": LmcacheKey(_DAEMON_SSD),
    "max_local_disk_size": LmcacheKey(_DAEMON_SSD),
    "local_disk_path_sharding": LmcacheKey(_DAEMON_SSD + " (one directory per daemon)"),
    "remote_url": LmcacheKey(_CLUSTER + "; no remote cache server of its own"),
    "remote_serde": LmcacheKey(NONE + "blocks are stored as they are, with a checksum"),
    "use_layerwise": LmcacheKey(NONE + "whole blocks are saved after the forward, loads end "
                                "before the request runs"),
    "save_decode_cache": LmcacheKey("every full block is saved, decode's included",
                                    _always(True, "every full block is saved, decode's "
                                            "included")),
    "save_unfull_chunk": LmcacheKey("only full blocks are stored",
                                    _always(False, "only full blocks are stored")),
    "discard_partial_chunks": LmcacheKey("only full blocks are stored",
                                         _always(True, "only full blocks are stored")),
    "enable_async_loading": LmcacheKey("loads are always asynchronous (a request waits, the "
                                       "step does not)",
                                       _always(True, "loads are always asynchronous")),
    "pre_caching_hash_algorithm": LmcacheKey(NONE + "keys are chained XXH3-128 over the "
                                             "namespace and tokens, verified on every hit"),
    "enable_blending": LmcacheKey(NONE + "CacheBlend (non-prefix reuse) is not implemented"),
    "blend_recompute_ratios": LmcacheKey(NONE + "CacheBlend is not implemented"),
    "blend_thresholds": LmcacheKey(NONE + "CacheBlend is not implemented"),
    "blend_check_layers": LmcacheKey(NONE + "CacheBlend is not implemented"),
    "blend_min_tokens": LmcacheKey(NONE + "CacheBlend is not implemented"),
    "blend_special_str": LmcacheKey(NONE + "CacheBlend is not implemented"),
    "enable_p2p": LmcacheKey(_CLUSTER),
    "p2p_host": LmcacheKey(_CLUSTER + " (--listen, --advertise)"),
    "p2p_init_ports": LmcacheKey(_CLUSTER + " (--listen)"),
    "p2p_lookup_ports": LmcacheKey(_CLUSTER),
    "enable_controller": LmcacheKey(_ADMIN),
    "controller_pull_url": LmcacheKey(_ADMIN),
    "controller_reply_url": LmcacheKey(_ADMIN),
    "controller_url": LmcacheKey(_ADMIN),
    "lmcache_instance_id": LmcacheKey(NONE + "each engine registers with its own id"),
    "lmcache_worker_ports": LmcacheKey(_ADMIN),
    "lmcache_worker_port": LmcacheKey(_ADMIN),
    "enable_pd": LmcacheKey(_ROLES),
    "enable_xpyd": LmcacheKey(_ROLES),
    "pd_role": LmcacheKey(_ROLES),
    "pd_buffer_size": LmcacheKey(_ROLES),
    "pd_buffer_device": LmcacheKey(_ROLES),
    "pd_peer_host": LmcacheKey(_ROLES),
    "pd_proxy_host": LmcacheKey(_ROLES),
    "pd_proxy_port": LmcacheKey(_ROLES),
    "transfer_channel": LmcacheKey(_ROLES),
    "nixl_role": LmcacheKey(_ROLES),
    "nixl_buffer_size": LmcacheKey(_ROLES),
    "nixl_buffer_device": LmcacheKey(_ROLES),
    "nixl_backends": LmcacheKey(_ROLES),
    "gds_path": LmcacheKey(_DAEMON_SSD + " (O_DIRECT: --ssd-io direct)"),
    "use_gds": LmcacheKey(_DAEMON_SSD + " (O_DIRECT: --ssd-io direct)"),
    "cache_policy": LmcacheKey("the daemon's eviction: kvstore serve --eviction lru|fifo"),
    "numa_mode": LmcacheKey(NONE + "the daemon's pool is one allocation"),
    "lookup_timeout_ms": LmcacheKey("lookup_timeout_s (seconds)",
                                    _milliseconds_to_lookup_timeout),
    "blocking_timeout_secs": LmcacheKey("load_timeout_s and save_timeout_s (a load's and a "
                                        "save's whole life)"),
    "min_retrieve_tokens": LmcacheKey(NONE + "vLLM loads every hit its scheduler is given"),
    "internal_api_server_enabled": LmcacheKey(_ADMIN),
    "internal_api_server_port_start": LmcacheKey(_ADMIN),
    "lmcache_rpc_port": LmcacheKey("kv_store_socket (the daemon's Unix socket)"),
    "extra_config": LmcacheKey(NONE + "the connector's settings are the keys listed in "
                               "docs/vllm.md"),
    "py_enable_gc": LmcacheKey(NONE),
    "priority_limit": LmcacheKey(NONE + "every request may use the store"),
}


# LMCache's defaults that ask for nothing kvstore does not do anyway (the daemon evicts LRU by
# default; keys are not LMCache's hash; one engine instance each).
DEFAULTS: dict[str, Any] = {
    "cache_policy": "lru", "remote_serde": "naive", "blend_special_str": " # # ",
    "lmcache_instance_id": "lmcache_default_instance", "chunk_size": 256,
    "pre_caching_hash_algorithm": "builtin", "min_retrieve_tokens": 0,
}


def asks_nothing(name: str, value: Any) -> bool:
    """Whether ``value`` leaves LMCache setting ``name`` off or at its default."""
    if value in (None, False, "", {}, []) or (type(value) in (int, float) and value == 0):
        return True
    default = DEFAULTS.get(name)
    if isinstance(default, str) and isinstance(value, str):
        return value.strip().lower() == default.strip().lower()
    return default is not None and type(value) is type(default) and value == default


def lmcache_name(key: str) -> str | None:
    """The LMCache setting ``key`` names (``lmcache.chunk_size`` or ``chunk_size``), if any."""
    name = key[len(PREFIX):] if key.startswith(PREFIX) else key
    return name if name in SETTINGS or key.startswith(PREFIX) else None


def take_lmcache(key: str, value: Any) -> tuple[str, Any] | None:
    """This connector's ``(key, value)`` for an LMCache setting (None: accepted as is); a
    ValueError naming the equivalent when it has no direct one or its value differs."""
    name = lmcache_name(key)
    assert name is not None
    found = SETTINGS.get(name)
    where = f"kv_connector_extra_config.{key} is an LMCache setting"
    if found is None:
        raise ValueError(f"{where} this connector does not know (docs/migrating-from-lmcache.md)")
    if found.take is None:
        if asks_nothing(name, value):
            return None  # accepted: nothing asked for
        raise ValueError(f"{where}; here: {found.equivalent} (docs/migrating-from-lmcache.md)")
    try:
        return found.take(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}; here: {found.equivalent}") from None


def lmcache_variables_note(env: Mapping[str, str]) -> str | None:
    """One line naming the ``LMCACHE_*`` variables set in ``env`` (this connector reads none of
    them: the daemon's ``KVSTORE_*`` do that job), or None."""
    found = sorted(v for v in env if v.startswith("LMCACHE_"))
    if not found:
        return None
    return (f"kvstore connector: {', '.join('$' + v for v in found)} "
            f"{'is an LMCache variable' if len(found) == 1 else 'are LMCache variables'} that "
            "kvstore does not read: the daemon's settings are kvstore serve's flags or "
            "$KVSTORE_* (docs/migrating-from-lmcache.md)")
