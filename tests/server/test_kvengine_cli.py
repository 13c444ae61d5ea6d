"""The `kvengine` command: serve as a real subprocess, clear errors for bad flags."""

from __future__ import annotations

import signal

import httpx
import pytest
from support.kvengine import KvengineProcess, run_kvengine


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_serve_starts_answers_and_stops(tiny_model_dir, stop_signal) -> None:
    served = KvengineProcess("--model", str(tiny_model_dir), "--served-model-name", "cli-tiny",
                             "--max-model-len", "256", "--num-kv-blocks", "64",
                             "--api-key", "k1", "--api-key", "k2", ready_timeout_s=60)
    try:
        url = served.url
        startup = served.ready_line
        assert "cli-tiny" in startup and "cpu" in startup and "64 KV blocks" in startup
        assert any("loading" in line for line in served.lines)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        headers = {"Authorization": "Bearer k2"}
        models = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()
        assert models["data"][0]["id"] == "cli-tiny"
        assert models["data"][0]["max_model_len"] == 256
        r = httpx.post(url + "/v1/completions", headers=headers, timeout=60,
                       json={"model": "cli-tiny", "prompt": "hello", "max_tokens": 3,
                             "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
    finally:
        returncode = served.stop(stop_signal)
    assert returncode == 0  # a graceful stop, the engine closed


@pytest.mark.parametrize(("args", "needle"), [
    ([], "COMMAND"),
    (["serve"], "--model"),
    (["serve", "--model", "MODEL", "--port", "-1"], "--port"),
    (["serve", "--model", "MODEL", "--port", "70000"], "--port"),
    (["serve", "--model", "MODEL", "--device", "tpu"], "--device"),
    (["serve", "--model", "MODEL", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["serve", "--model", "MODEL", "--gpu-memory-utilization", "1.5"], "--gpu-memory-util"),
    (["serve", "--model", "MODEL", "--kv-offload-policy", "lru"], "--kv-offload-policy"),
    (["serve", "--model", "/no/such/dir"], "no such directory"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_flags_exit_nonzero_with_a_message(tiny_model_dir, capsys, args, needle) -> None:
    from server.cli import main

    args = [str(tiny_model_dir) if a == "MODEL" else a for a in args]
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_make_model_is_dispatched_to_the_engine() -> None:
    result = run_kvengine(["make-model", "--help"], timeout_s=60)
    assert result.returncode == 0, result.stderr
    assert "--preset" in result.stdout
