"""The connector's settings are refused while vLLM builds its config (issue 38 item 3): one line
naming the key and the fix, before any model loads. The check itself runs without vLLM; the
tests marked ``vllm`` start a real one with a bad key."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.testing.vllm_process import SOURCE_ROOT, VllmProcess
from offload.vllm.settings import (
    MAX_SOCKET_PATH_BYTES,
    ConnectorSettings,
    SettingsError,
    check_extra_config,
)

BAD = [
    ({"lookup_timeout": 1.0}, "unknown key 'lookup_timeout': did you mean 'lookup_timeout_s'"),
    ({"zzz": 1, "yyy": 2}, "unknown key 'yyy' (and ['zzz'])"),
    ({"load_blocks": 1.5}, "load_blocks must be a positive integer, got 1.5"),
    ({"load_blocks": "many"}, "load_blocks must be a positive integer, got 'many'"),
    ({"save_blocks": True}, "save_blocks must be a positive integer, got True"),
    ({"save_blocks": [8]}, "save_blocks must be a positive integer"),
    ({"save_blocks": 0}, "save_blocks must be a positive integer, got 0"),
    ({"load_timeout_s": "soon"}, "load_timeout_s must be a positive number of seconds, got "
                                 "'soon'"),
    ({"load_timeout_s": {"s": 1}}, "load_timeout_s must be a positive number of seconds"),
    ({"save_timeout_s": "nan"}, "save_timeout_s must be a positive number of seconds"),
    ({"lookup_timeout_s": -1}, "lookup_timeout_s must be a positive number of seconds"),
    ({"kv_store_socket": 5}, "kv_store_socket must be a path (a string), got 5"),
    ({"kv_store_socket": "/s/" + "x" * MAX_SOCKET_PATH_BYTES}, "longer than a Unix socket"),
    ({"lmcache.enable_blending": True}, "CacheBlend"),
    ({"lmcache.max_local_cpu_size": 5.0}, "kvstore serve --dram"),
    ({"lmcache.local_cpu": "sometimes"}, "expected true or false, got 'sometimes'"),
    ({"lmcache.lookup_timeout_ms": -5}, "lmcache.lookup_timeout_ms (as lookup_timeout_s) must "
                                        "be a positive number of seconds, got -0.005"),
    ({"lookup_timeout_ms": 100, "lookup_timeout_s": 0.2}, "one setting: give one"),
]


@pytest.mark.parametrize(("extra", "needle"), BAD)
def test_a_bad_setting_is_one_line_naming_the_key(extra: dict, needle: str) -> None:
    with pytest.raises(SettingsError) as info:
        check_extra_config(extra)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message and message.startswith("kvstore connector: ")
    assert any(f"{k}" in message for k in extra)
    with pytest.raises(ValueError, match="kvstore connector: "):  # the constructor's read too
        ConnectorSettings.from_extra_config(extra)


def test_an_lmcache_refusal_names_the_fix() -> None:
    with pytest.raises(SettingsError) as info:
        check_extra_config({"lmcache.local_disk": "file:///mnt/nvme/"})
    assert "kvstore serve --ssd-dir" in str(info.value)
    assert str(info.value).endswith("remove lmcache.local_disk")


def test_extra_config_must_be_an_object() -> None:
    with pytest.raises(SettingsError, match="must be a JSON object"):
        check_extra_config(["kv_store_socket"])  # type: ignore[arg-type]


def test_a_socket_path_that_is_a_folder_or_a_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="is a folder: name the socket in it"):
        check_extra_config({"kv_store_socket": str(tmp_path)})
    plain = tmp_path / "kvstore.sock"
    plain.write_text("")
    with pytest.raises(SettingsError, match="is not a socket"):
        check_extra_config({"kv_store_socket": str(plain)})


def test_a_socket_not_there_yet_or_listening_is_accepted(tmp_path: Path) -> None:
    """The daemon may start after vLLM (a pod's containers): vLLM recomputes until it is up."""
    later = tmp_path / "later" / "kvstore.sock"
    assert check_extra_config({"kv_store_socket": str(later)}).kv_store_socket == str(later)
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(path))
        assert check_extra_config({"kv_store_socket": str(path)}).kv_store_socket == str(path)
    assert check_extra_config({"kv_store_socket": ""}) == ConnectorSettings()


def test_good_settings_read_the_same_both_ways(caplog: pytest.LogCaptureFixture) -> None:
    """The config-time check logs nothing (vLLM asks for the class several times); the
    constructor's read notes each LMCache key once."""
    extra = {"kv_store_socket": "/tmp/kvstore.sock", "load_blocks": "16",
             "save_timeout_s": 2, "lmcache.enable_p2p": False,
             "lmcache.lookup_timeout_ms": 500, "lmcache.cache_policy": "LRU"}
    def ours() -> list[logging.LogRecord]:  # the settings' own lines, not another test's
        return [r for r in caplog.records if r.name == "offload.vllm"]

    with caplog.at_level("INFO", logger="offload.vllm"):
        checked = check_extra_config(extra)
        assert not ours()
        read = ConnectorSettings.from_extra_config(extra, env={})
    assert checked == read
    assert (read.load_blocks, read.lookup_timeout_s) == (16, 0.5)
    notes = [r.getMessage() for r in ours()]
    assert len(notes) == 3 and all(n.startswith("kvstore connector: LMCache's") for n in notes)


def test_lmcache_keys_at_their_off_or_default_values_are_accepted() -> None:
    """A moved LMCache configuration often lists every key (issue 38: ``enable_p2p: false``,
    ``cache_policy: LRU``, ``use_layerwise: false``, ``remote_url: null``...)."""
    extra = {"lmcache.enable_p2p": False, "lmcache.cache_policy": "LRU",
             "lmcache.use_layerwise": False, "lmcache.remote_url": None,
             "lmcache.local_disk": "", "lmcache.max_local_disk_size": 0.0,
             "lmcache.chunk_size": 256, "lmcache.enable_controller": False,
             "lmcache.enable_pd": False, "lmcache.pd_role": None, "lmcache.use_gds": False,
             "lmcache.save_decode_cache": True, "lmcache.local_cpu": True,
             "numa_mode": None, "min_retrieve_tokens": 0,
             "pre_caching_hash_algorithm": "builtin", "lmcache.extra_config": {}}
    assert check_extra_config(extra) == ConnectorSettings()


# ---------------------------------------------------------------------- with a real vLLM

def _wait_for(proc: VllmProcess, needle: str, timeout_s: float = 10.0) -> list[str]:
    """The child's output lines holding ``needle`` (its log is pumped by a thread)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [line for line in proc.lines if needle in line]
        if found:
            return found
        time.sleep(0.1)
    return []


@pytest.mark.vllm
def test_vllm_hands_out_the_class_only_for_good_settings() -> None:
    """Both ways vLLM's factory loads the class (the name, the module path) check the settings
    it asks with; so does the CUDA graph question vLLM asks on GPUs."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import kvstore_tiered_vllm

    kvstore_tiered_vllm.register()
    for module_path in (None, "offload.vllm_connector"):
        good = KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both",
                                kv_connector_module_path=module_path,
                                kv_connector_extra_config={"load_blocks": 8})
        cls = KVConnectorFactory.get_connector_class(good)
        assert cls.__name__ == "KVStoreConnector"
        bad = KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both",
                               kv_connector_module_path=module_path,
                               kv_connector_extra_config={"load_block": 8})
        with pytest.raises(SettingsError, match="unknown key 'load_block'"):
            KVConnectorFactory.get_connector_class(bad)
    assert cls.requires_piecewise_for_cudagraph({"save_blocks": 4}) is False
    with pytest.raises(SettingsError, match="save_blocks must be a positive integer"):
        cls.requires_piecewise_for_cudagraph({"save_blocks": -4})


@pytest.mark.vllm
def test_a_bad_key_stops_vllm_before_its_model_loads(small_model_dir, tmp_path) -> None:
    """``LLM(...)`` (the module path, engine in this process): the config is refused."""
    start = time.monotonic()
    proc = VllmProcess(small_model_dir, tmp_path / "kvstore.sock",
                       extra={"lmcache.enable_blending": True}, wait=False)
    try:
        returncode = proc.proc.wait(timeout=180)
        elapsed_s = time.monotonic() - start
        refused = _wait_for(proc, "kvstore connector: kv_connector_extra_config.lmcache.")
    finally:
        proc.stop()
    out = "\n".join(proc.lines)
    assert returncode != 0
    assert len(refused) == 1 and "CacheBlend" in refused[0], out[-3000:]
    assert "remove lmcache.enable_blending" in refused[0]
    assert "Loading weights" not in out and "Creating v1 connector" not in out, out[-3000:]
    print(f"refused {elapsed_s:.1f} s after launch")
    assert elapsed_s < 120


@pytest.mark.vllm
def test_vllm_serve_refuses_a_bad_key_in_its_front_process(small_model_dir, tmp_path) -> None:
    """The OpenAI server, the connector by name (the plugin): the front process refuses the
    config before it starts an engine process; no worker tracebacks."""
    config = ('{"kv_connector": "KVStoreConnector", "kv_role": "kv_both", '
              '"kv_connector_extra_config": {"kv_store_socket": "%s", '
              '"lookup_timout_s": 2}}' % (tmp_path / "kvstore.sock"))
    env = {**os.environ, "PYTHONPATH": str(SOURCE_ROOT)}
    env.pop("KVSTORE_SOCKET", None)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
         str(small_model_dir), "--port", "0", "--max-model-len", "2048",
         "--kv-cache-memory-bytes", str(64 << 20), "--kv-transfer-config", config],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    elapsed_s = time.monotonic() - start
    out = done.stdout + done.stderr
    assert done.returncode != 0
    refused = [line for line in out.splitlines() if "kvstore connector: " in line]
    assert len(refused) == 1, out[-3000:]
    assert "unknown key 'lookup_timout_s': did you mean 'lookup_timeout_s'?" in refused[0]
    assert "EngineCore" not in out and "Loading weights" not in out, out[-3000:]
    assert out.count("Traceback") == 1
    print(f"refused {elapsed_s:.1f} s after launch")
    assert elapsed_s < 120
