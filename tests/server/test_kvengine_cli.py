"""The `kvengine` command: serve as a real subprocess, clear errors for bad flags."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

CLI = [sys.executable, "-m", "server.cli"]


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_serve_starts_answers_and_stops(tiny_model_dir, stop_signal) -> None:
    cmd = CLI + ["serve", "--model", str(tiny_model_dir), "--device", "cpu", "--port", "0",
                 "--served-model-name", "cli-tiny", "--max-model-len", "256",
                 "--num-kv-blocks", "64", "--api-key", "k1", "--api-key", "k2"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        lines = []
        deadline = time.monotonic() + 60
        url = None
        for line in proc.stderr:
            lines.append(line)
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                url = match.group(1)
                break
            assert time.monotonic() < deadline, "".join(lines)
        assert url is not None, "".join(lines)
        startup = lines[-1]
        assert "cli-tiny" in startup and "cpu" in startup and "64 KV blocks" in startup
        assert any("loading" in line for line in lines)
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
        proc.send_signal(stop_signal)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0  # a graceful stop, the engine closed


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
    result = subprocess.run(CLI + ["make-model", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--preset" in result.stdout
