"""LMCache's settings in ``kv_connector_extra_config`` (issue 30 item 2): taken where they have a
direct equivalent, accepted where their value is what kvstore always does, refused with the
equivalent named otherwise; docs/migrating-from-lmcache.md covers every one of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from offload.vllm.lmcache_keys import SETTINGS
from offload.vllm.settings import ConnectorSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-lmcache.md"


@pytest.mark.parametrize("key", ["lmcache.lookup_timeout_ms", "lookup_timeout_ms"])
def test_a_direct_equivalent_is_taken(key: str) -> None:
    assert ConnectorSettings.from_extra_config({key: 250}).lookup_timeout_s == 0.25


def test_values_kvstore_always_has_are_accepted() -> None:
    settings = ConnectorSettings.from_extra_config({
        "lmcache.save_decode_cache": True, "discard_partial_chunks": True,
        "lmcache.local_cpu": "true", "lmcache.enable_async_loading": True,
        "lmcache.save_unfull_chunk": False, "kv_store_socket": "/tmp/x.sock"})
    assert settings == ConnectorSettings(kv_store_socket="/tmp/x.sock")


def test_settings_left_off_or_at_lmcache_defaults_are_accepted() -> None:
    """A moved configuration often lists every key at its default: those ask for nothing."""
    settings = ConnectorSettings.from_extra_config({
        "lmcache.enable_p2p": False, "lmcache.remote_url": None, "lmcache.cache_policy": "LRU",
        "lmcache.use_layerwise": False, "lmcache.local_disk": None,
        "lmcache.max_local_disk_size": 0, "lmcache.chunk_size": 256,
        "lmcache.enable_blending": False, "lmcache.blend_special_str": " # # ",
        "lmcache.remote_serde": "naive", "lmcache.enable_controller": False})
    assert settings == ConnectorSettings()


@pytest.mark.parametrize(("extra", "needle"), [
    ({"lmcache.max_local_cpu_size": 5.0}, "kvstore serve --dram"),
    ({"lmcache.local_disk": "file:///mnt/nvme/"}, "kvstore serve --ssd-dir"),
    ({"lmcache.remote_url": "lm://host:65432"}, "--cluster redis://"),
    ({"lmcache.chunk_size": 512}, "vLLM's --block-size"),
    ({"lmcache.enable_blending": True}, "CacheBlend"),
    ({"lmcache.cache_policy": "LFU"}, "--eviction lru|fifo"),
    ({"lmcache.save_decode_cache": False}, "decode's included"),
    ({"lmcache.save_unfull_chunk": True}, "only full blocks"),
    ({"lmcache.blocking_timeout_secs": 5}, "load_timeout_s and save_timeout_s"),
    ({"lmcache.some_new_setting": 1}, "LMCache setting this connector does not know"),
    ({"lookup_timeout_ms": 100, "lookup_timeout_s": 0.2}, "one setting: give one"),
])
def test_others_are_refused_with_the_equivalent_named(extra: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("|", r"\|")) as info:
        ConnectorSettings.from_extra_config(extra)
    assert "migrating-from-lmcache" in str(info.value) or "lookup_timeout" in str(info.value) \
        or "here:" in str(info.value)


def test_a_typo_of_our_own_keys_is_still_an_unknown_key() -> None:
    with pytest.raises(ValueError, match="unknown key 'lookup_timeout': did you mean "
                                         "'lookup_timeout_s'"):
        ConnectorSettings.from_extra_config({"lookup_timeout": 1.0})


def test_the_migration_guide_names_every_lmcache_setting() -> None:
    text = DOC.read_text()
    missing = [name for name in SETTINGS if f"`{name}`" not in text]
    assert not missing, missing


def test_lmcache_variables_are_named_in_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    env = {"LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "True", "KVSTORE_DRAM": "1Gi"}
    with caplog.at_level("WARNING", logger="offload.vllm"):
        ConnectorSettings.from_extra_config({}, env=env)
        ConnectorSettings.from_extra_config({}, env={"PATH": "/bin"})
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "$LMCACHE_CHUNK_SIZE, $LMCACHE_LOCAL_CPU are LMCache variables" in warnings[0]
