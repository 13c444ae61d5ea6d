"""vLLM's harmless flags on `kvengine serve` (issue 30 item 6): accepted with one line at start
that says why they change nothing; the ones with a value only with the value kvengine behaves
by; `--root-path` honoured; flags whose effect kvengine lacks still refused in one line."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from support.kvengine import KvengineProcess, run_kvengine


def test_harmless_flags_start_with_a_note_each(tiny_model_dir: Path) -> None:
    args = [str(tiny_model_dir), "--disable-log-requests", "--disable-log-stats",
            "--enable-chunked-prefill", "--load-format", "safetensors", "--response-role",
            "assistant", "--max-logprobs", "20", "--root-path", "/api",
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log", "-pp", "1",
            "--kv-cache-dtype", "auto", "--distributed-executor-backend", "mp",
            "--structured-outputs-config.backend", "guidance", "--swap-space", "4",
            "--max-log-len", "100"]
    with KvengineProcess(*args) as served:
        text = "".join(served.lines)
        for flag in ("--disable-log-requests", "--disable-log-stats",
                     "--enable-chunked-prefill", "--load-format safetensors",
                     "--response-role assistant", "--max-logprobs 20",
                     "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
                     "--pipeline-parallel-size 1", "--kv-cache-dtype auto",
                     "--distributed-executor-backend mp",
                     "--structured-outputs-config.backend guidance", "--swap-space",
                     "--max-log-len"):
            assert f"kvengine: {flag} " in text, (flag, text)
        schema = httpx.get(served.url + "/openapi.json", timeout=10).json()
        assert schema["servers"] == [{"url": "/api"}]  # the proxy's prefix, as uvicorn's
        r = httpx.post(served.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize(("args", "needle"), [
    (["--max-logprobs", "5"], "fixed at 20"),
    (["--response-role", "bot"], "role assistant"),
    (["--load-format", "pt"], "safetensors only"),
    (["--download-dir", "/models"], "HF_HUB_CACHE"),
    (["-pp", "2"], "one device"),
    (["--kv-cache-dtype", "fp8"], "model's dtype"),
    (["--distributed-executor-backend", "ray"], "without Ray"),
    (["--structured-outputs-config.backend", "xgrammar"], "llguidance"),
    (["--enable-log-requests"], "does not log requests"),
    (["--no-enable-chunked-prefill"], "unrecognized arguments"),
    (["--speculative-config", "{}"], "unrecognized arguments"),
])
def test_flags_without_their_effect_are_refused_in_one_line(tiny_model_dir: Path, args: list[str],
                                                            needle: str) -> None:
    out = run_kvengine(["serve", str(tiny_model_dir), "--device", "cpu", "--port", "0", *args])
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and needle in errors[0], out.stderr


def test_vllm_variables_kvengine_does_not_read_are_named_once(tiny_model_dir: Path) -> None:
    env = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_LOGGING_LEVEL": "DEBUG",
           "VLLM_API_KEY": None}
    with KvengineProcess(str(tiny_model_dir), env=env) as served:
        lines = [ln for ln in served.lines if "VLLM_" in ln]
    assert len(lines) == 1, lines
    assert "$VLLM_LOGGING_LEVEL, $VLLM_WORKER_MULTIPROC_METHOD are vLLM settings" in lines[0]
