"""A `vllm serve` command line moved to kvengine: each vLLM flag honoured or refused in one line,
through a real `kvengine serve` process and a real HTTP client."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import pytest
from support.kvengine import KvengineProcess, run_kvengine

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) \S+: ")


def test_positional_model_and_vllm_flags(tiny_model_dir: Path, tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("CUSTOM:{% for m in messages %}{{ m['content'] }}{% endfor %}")
    args = [str(tiny_model_dir), "--enable-prefix-caching", "--dtype", "auto", "--seed", "3",
            "--trust-remote-code", "--tensor-parallel-size", "1",
            "--num-gpu-blocks-override", "48", "--served-model-name", "first", "second",
            "--uvicorn-log-level", "warning", "--log-level", "info",
            "--chat-template", str(template), "--max-model-len", "256"]
    with KvengineProcess(*args, env={"KVENGINE_API_KEY": "env-key"}) as served:
        url = served.url
        assert "48 KV blocks" in served.ready_line
        # --log-level reaches the engine's own logger, with time, level and logger name.
        assert any(LOG_LINE.match(line) and " INFO engine: attention: " in line
                   for line in served.lines), "".join(served.lines)
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        auth = {"Authorization": "Bearer env-key"}
        models = httpx.get(url + "/v1/models", headers=auth, timeout=10).json()
        assert [card["id"] for card in models["data"]] == ["first", "second"]
        r = httpx.post(url + "/v1/completions", headers=auth, timeout=60,
                       json={"model": "second", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "first"
        assert httpx.post(url + "/v1/completions", headers=auth, timeout=60, json={
            "model": "third", "prompt": "hi", "max_tokens": 2}).status_code == 404
        # The chat template came from --chat-template, not the tokenizer folder.
        tokens = httpx.post(url + "/tokenize", headers=auth, timeout=10, json={
            "messages": [{"role": "user", "content": "hello"}]}).json()["tokens"]
        text = httpx.post(url + "/detokenize", headers=auth, timeout=10,
                          json={"tokens": tokens}).json()["prompt"]
        assert text == "CUSTOM:hello"


def test_seed_makes_unseeded_sampling_repeat(tiny_model_dir: Path) -> None:
    body = {"prompt": "once upon", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    runs = []
    for seed in ("11", "11", "12"):
        with KvengineProcess(str(tiny_model_dir), "--seed", seed) as served:
            r = httpx.post(served.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200
            runs.append(r.json()["choices"][0]["text"])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_generation_config_defaults_and_overrides(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=1.0, top_k=1)  # top_k 1 makes sampling greedy
    (model / "generation_config.json").write_text(json.dumps(config))
    base = {"prompt": "the model's defaults", "max_tokens": 8, "ignore_eos": True}
    with KvengineProcess(str(model)) as served:
        post = lambda extra: httpx.post(served.url + "/v1/completions",  # noqa: E731
                                        json={**base, **extra}, timeout=60).json()
        greedy = post({"temperature": 0.0})["choices"][0]["text"]
        assert post({})["choices"][0]["text"] == greedy  # top_k 1 from generation_config
        assert post({"seed": 1})["choices"][0]["text"] == greedy
        # A field the request sends wins over the model's default: top_k 0 is "off".
        assert post({"top_k": 0, "seed": 1})["choices"][0]["text"] != greedy
    with KvengineProcess(str(model), "--generation-config", "vllm") as served:
        r = httpx.post(served.url + "/v1/completions", json={**base, "seed": 1}, timeout=60)
        assert r.json()["choices"][0]["text"] != greedy  # vLLM's own defaults: temperature 1


@pytest.mark.parametrize(("args", "code", "needle"), [
    (["--tensor-parallel-size", "2"], 2, "2 is not supported"),
    (["--dtype", "float16"], 1, "--dtype float16 is not supported on cpu"),
    (["--dtype", "bf16"], 1, "--dtype bfloat16 is not supported on cpu"),
    (["--chat-template", "no/such/template.jinja"], 2, "no such file"),
    (["--generation-config", "/no/such/folder"], 2, "no generation_config.json"),
    (["--model", "/elsewhere"], 2, "differ: give one"),
])
def test_refusals_are_one_line(tiny_model_dir: Path, args: list[str], code: int,
                               needle: str) -> None:
    out = run_kvengine(["serve", str(tiny_model_dir), "--device", "cpu", "--port", "0", *args])
    assert out.returncode == code, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and needle in errors[0], out.stderr


def test_dtype_float32_is_what_cpu_computes_in(tiny_model_dir: Path) -> None:
    with KvengineProcess(str(tiny_model_dir), "--dtype", "float32") as served:
        assert httpx.get(served.url + "/health", timeout=10).status_code == 200
        # The default --log-level (warning) keeps the engine's info lines out.
        assert not any(" INFO engine:" in line for line in served.lines), served.lines


def test_tokenizer_from_another_folder(tiny_model_dir: Path, tmp_path: Path) -> None:
    """--tokenizer: the weights' folder has no tokenizer; the tokenizer folder has one."""
    weights, tokenizer = tmp_path / "weights", tmp_path / "tokenizer"
    shutil.copytree(tiny_model_dir, weights)
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.move(weights / name, tokenizer / name)
    out = run_kvengine(["serve", str(weights), "--device", "cpu", "--port", "0"])
    assert out.returncode == 1 and "no tokenizer.json" in out.stderr
    with KvengineProcess(str(weights), "--tokenizer", str(tokenizer)) as served:
        r = httpx.post(served.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_help_names_the_vllm_flags() -> None:
    out = run_kvengine(["serve", "--help"])
    assert out.returncode == 0
    for flag in ("--enable-prefix-caching", "--dtype", "--seed", "--chat-template",
                 "--uvicorn-log-level", "--trust-remote-code", "--tensor-parallel-size",
                 "--tokenizer", "--num-gpu-blocks-override", "--generation-config"):
        assert flag in out.stdout, flag
    help_text = " ".join(out.stdout.split())
    assert "never runs code from a model folder" in help_text
    assert "KVENGINE_API_KEY" in help_text
