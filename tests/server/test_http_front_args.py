"""The HTTP-front options, defined once (server/http_front_args.py) for `kvengine serve` and
`kvengine router`: the same values from the same command lines and environment, the same
refusals, each program's own help."""

from __future__ import annotations

import argparse

import pytest

from server.cli import build_parser
from server.http_front_args import api_keys, metrics_key

FRONT = ["--host", "::1", "--port", "0", "--api-key", "k1", "--api-key", "k2", "--metrics-key",
         "op", "--max-request-body-bytes", "1000", "--max-connections", "7",
         "--timeout-keep-alive", "2.5", "--request-read-timeout", "9", "--log-level", "info",
         "--uvicorn-log-level", "trace"]
DESTS = ("host", "port", "api_key", "metrics_key", "max_request_body_bytes", "max_connections",
         "timeout_keep_alive", "request_read_timeout", "log_level", "uvicorn_log_level")
PROGRAMS = {"serve": ["serve", "/models/m"],
            "router": ["router", "/models/m", "--engine", "http://127.0.0.1:8001"]}


def _front(argv: list[str]) -> dict:
    args = build_parser().parse_args(argv)
    return {dest: getattr(args, dest) for dest in DESTS}


def test_both_programs_read_the_front_alike() -> None:
    serve, router = (_front(PROGRAMS[name] + FRONT) for name in ("serve", "router"))
    assert serve == router == {
        "host": "::1", "port": 0, "api_key": ["k1", "k2"], "metrics_key": "op",
        "max_request_body_bytes": 1000, "max_connections": 7, "timeout_keep_alive": 2.5,
        "request_read_timeout": 9.0, "log_level": "info", "uvicorn_log_level": "trace"}
    defaults = [_front(PROGRAMS[name]) for name in ("serve", "router")]
    assert defaults[0] == defaults[1]
    assert defaults[0]["port"] == 8000 and defaults[0]["max_request_body_bytes"] == 4 << 20


@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("bad", [["--port", "70000"], ["--max-connections", "0"],
                                 ["--timeout-keep-alive", "0"], ["--log-level", "loud"]])
def test_both_programs_refuse_the_same_values(program: str, bad: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(PROGRAMS[program] + bad)
    assert info.value.code == 2
    assert bad[0] in capsys.readouterr().err


def test_keys_come_from_the_flags_else_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("KVENGINE_API_KEY", "from-env")
    monkeypatch.setenv("KVENGINE_METRICS_KEY", "op-env")
    given = argparse.Namespace(api_key=["a", "b"], metrics_key="op")
    unset = argparse.Namespace(api_key=None, metrics_key=None)
    assert (api_keys(given), metrics_key(given)) == (("a", "b"), "op")
    assert (api_keys(unset), metrics_key(unset)) == (("from-env",), "op-env")
    monkeypatch.delenv("KVENGINE_API_KEY")
    monkeypatch.delenv("KVENGINE_METRICS_KEY")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert (api_keys(unset), metrics_key(unset)) == ((), None)
    # a migrated vLLM deployment's key: read after ours, never served without it
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert api_keys(unset) == ("from-vllm",)
    monkeypatch.setenv("KVENGINE_API_KEY", "ours")
    assert api_keys(unset) == ("ours",)


@pytest.mark.parametrize(("program", "own"), [
    ("serve", "require 'Authorization: Bearer KEY'"),
    ("router", "the keys the engines were given"),
])
def test_each_help_has_the_front_in_its_own_words(program: str, own: str, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([program, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "HTTP front:" in text and own in text
    assert "$KVENGINE_API_KEY" in text and "$KVENGINE_METRICS_KEY" in text
    for flag in ("--host", "--port", "--max-connections", "--uvicorn-log-level"):
        assert flag in text.split("HTTP front:", 1)[1], flag
