"""Options from a config file and the environment (issue 30 item 6): keys are the long flag names,
the command line wins over ``PREFIX_NAME`` variables, which win over ``--config FILE``; argparse
checks what they give as it checks typed flags. Then the real programs: ``kvstore serve`` and
``kvengine serve`` started with a file and variables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.kvengine import KvengineProcess

from kvstore.cli.args import (
    OneLineParser,
    add_config_option,
    expand_sources,
    positive_float_arg,
    size_arg,
)

REPO_ROOT = Path(__file__).resolve().parents[3]


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="demo serve")
    add_config_option(parser, "DEMO_", "DRAM=16Gi")
    parser.add_argument("--dram", type=size_arg, default=1)
    parser.add_argument("--ssd-dir", default=None)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--enable-cache", action="store_true", default=True)
    parser.add_argument("--no-enable-cache", dest="enable_cache", action="store_false")
    parser.add_argument("--name", nargs="+", default=None)
    parser.add_argument("--key", action="append", default=None)
    return parser


def _parse(argv: list[str], env: dict[str, str] | None = None, config: str | None = None,
           tmp_path: Path | None = None):
    if config is not None:
        assert tmp_path is not None
        path = tmp_path / "options.yaml"
        path.write_text(config)
        argv = ["--config", str(path), *argv]
    parser = _parser()
    return parser.parse_args(expand_sources(parser, argv, "DEMO_", env or {}))


def test_file_then_environment_then_command_line(tmp_path: Path) -> None:
    config = "dram: 2Gi\nssd_dir: /from/file\nverbose: true\nname: [a, b]\nkey: [k1, k2]\n"
    args = _parse([], {}, config, tmp_path)
    assert (args.dram, args.ssd_dir, args.verbose) == (2 << 30, "/from/file", True)
    assert args.name == ["a", "b"] and args.key == ["k1", "k2"]
    args = _parse([], {"DEMO_DRAM": "3G", "DEMO_VERBOSE": "0"}, config, tmp_path)
    assert args.dram == 3 * 10**9 and args.verbose is False and args.ssd_dir == "/from/file"
    args = _parse(["--dram", "4Mi", "--key", "cli"], {"DEMO_DRAM": "3G", "DEMO_KEY": "env"},
                  config, tmp_path)
    assert args.dram == 4 << 20 and args.key == ["cli"]  # given once: never appended to


def test_false_switches_take_their_no_twin(tmp_path: Path) -> None:
    assert _parse([], {}, "enable-cache: false\n", tmp_path).enable_cache is False
    assert _parse([], {"DEMO_ENABLE_CACHE": "off"}).enable_cache is False
    assert _parse(["--no-enable-cache"], {"DEMO_ENABLE_CACHE": "1"}).enable_cache is False
    assert _parse([], {}).enable_cache is True


@pytest.mark.parametrize(("config", "env", "needle"), [
    ("dramm: 1Gi\n", {}, "'dramm' is not an option of demo serve"),
    ("- dram\n", {}, "expected a mapping"),
    ("dram: [\n", {}, "not YAML"),
    ("verbose: maybe\n", {}, "--verbose is a switch"),
    ("dram: [1Gi, 2Gi]\n", {}, "--dram takes one value"),
    ("", {"DEMO_VERBOSE": "sometimes"}, "$DEMO_VERBOSE: --verbose is a switch"),
])
def test_bad_sources_are_named(tmp_path: Path, config: str, env: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("$", r"\$").replace("[", r"\[")):
        _parse([], env, config, tmp_path)


def test_a_bad_value_is_refused_like_a_typed_one(capsys) -> None:
    with pytest.raises(SystemExit):
        _parse([], {"DEMO_DRAM": "lots"})
    assert "invalid size 'lots'" in capsys.readouterr().err


def test_yaml_1_1_booleans_stay_words_and_infinity_is_no_bound(tmp_path: Path, capsys) -> None:
    """``http: off`` reached --http as 'False' (YAML 1.1 reads yes/no/on/off as booleans);
    ``.inf`` was taken as a timeout that never fires."""
    parser = OneLineParser(prog="demo serve")
    add_config_option(parser, "DEMO_", "DRAM=16Gi")
    parser.add_argument("--http", default="127.0.0.1:1")
    parser.add_argument("--pin", choices=("auto", "yes", "no"), default="auto")
    parser.add_argument("--idle-timeout", type=positive_float_arg, default=1.0)
    parser.add_argument("--verbose", action="store_true")
    path = tmp_path / "options.yaml"
    path.write_text("http: off\npin: no\nverbose: true\n")
    args = parser.parse_args(expand_sources(parser, ["--config", str(path)], "DEMO_", {}))
    assert (args.http, args.pin, args.verbose) == ("off", "no", True)
    path.write_text("idle-timeout: .inf\n")
    with pytest.raises(SystemExit):
        parser.parse_args(expand_sources(parser, ["--config", str(path)], "DEMO_", {}))
    assert "expected a finite number" in capsys.readouterr().err


def test_unknown_variables_of_the_prefix_are_named(caplog) -> None:
    with caplog.at_level("WARNING", logger="kvstore"):
        _parse([], {"DEMO_DRAM": "1Gi", "DEMO_DRAMM": "2Gi", "DEMO_DEBUG_X": "1"})
    assert "$DEMO_DRAMM is not an option of demo serve" in caplog.text
    assert "DEMO_DRAM " not in caplog.text and "DEBUG" not in caplog.text


def test_the_kernels_variables_are_not_taken_for_unknown_options(caplog) -> None:
    import argparse

    import kernels.attention_backends as backends
    import kernels.plan_builder as plan_builder
    import kernels.plan_cache as plan_cache
    from kvstore.cli.args import READ_ELSEWHERE

    assert plan_cache.ENV in READ_ELSEWHERE and plan_builder.ENV in READ_ELSEWHERE
    # still the name the backend choice reads
    assert "KVSTORE_ATTENTION" in Path(backends.__file__).read_text()
    parser = argparse.ArgumentParser(prog="kvstore serve")
    parser.add_argument("--dram")
    with caplog.at_level("WARNING", logger="kvstore"):
        expand_sources(parser, [], "KVSTORE_", {"KVSTORE_ATTENTION": "ours",
                                               "KVSTORE_CUDNN_PLAN_CACHE": "off",
                                               "KVSTORE_DRAMM": "1"})
    assert "KVSTORE_DRAMM" in caplog.text
    assert "ATTENTION" not in caplog.text and "PLAN_CACHE" not in caplog.text


def test_max_connections_past_the_fd_limit_is_refused() -> None:
    import argparse
    import resource

    from kvstore.cli.limits import limits_from_args

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    args = argparse.Namespace(max_connections=soft + 1, max_buffered_bytes=1 << 20,
                              frame_timeout=1.0, idle_timeout=1.0, slow_reader_timeout=1.0)
    with pytest.raises(ValueError, match="ulimit -n"):
        limits_from_args(args)


def _daemon_banner(argv: list[str], env: dict[str, str]) -> str:
    """The first lines `kvstore serve` prints, up to ready (then it is stopped)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO_ROOT, env=env)
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "kvstore: ready" in line or "error" in line:
                break
    finally:
        proc.terminate()
        proc.wait(20)
    return "".join(lines)


def test_kvstore_serve_reads_a_config_file_and_the_environment(tmp_path: Path) -> None:
    import os
    import tempfile

    sock_dir = Path(tempfile.mkdtemp(prefix="kvs-"))
    config = tmp_path / "kvstore.yaml"
    config.write_text(f"socket: {sock_dir}/kvstore.sock\ndram: 8Mi\nhttp: 'off'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    banner = _daemon_banner(["--config", str(config)], env)
    assert "DRAM pool 8.00 MiB" in banner and f"{sock_dir}/kvstore.sock" in banner, banner
    banner = _daemon_banner(["--config", str(config)], {**env, "KVSTORE_DRAM": "12Mi"})
    assert "DRAM pool 12.0 MiB" in banner, banner
    banner = _daemon_banner(["--config", str(config), "--dram", "10Mi"],
                            {**env, "KVSTORE_DRAM": "12Mi"})
    assert "DRAM pool 10.0 MiB" in banner, banner
    config.write_text("dram: 8Mi\nssd-dri: /x\n")
    out = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--config", str(config)],
                         capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=60)
    assert out.returncode == 2 and "'ssd-dri' is not an option of kvstore serve" in out.stderr


def test_kvengine_serve_reads_a_config_file_and_the_environment(tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    config = tmp_path / "kvengine.yaml"
    config.write_text(f"model: {tiny_model_dir}\nmax-model-len: 128\n"
                      "served-model-name: [from-file]\n")
    with KvengineProcess("--config", str(config),
                         env={"KVENGINE_MAX_MODEL_LEN": "192"}) as served:
        assert "serving from-file" in served.ready_line
        assert "max_model_len 192" in served.ready_line, served.ready_line


def test_kvengine_router_takes_a_config_file_and_the_environment(tmp_path: Path) -> None:
    from kvstore.cli.args import subcommand
    from server.cli import build_parser

    config = tmp_path / "router.yaml"
    config.write_text("model: /models/m\nengine: [http://127.0.0.1:8001, http://127.0.0.1:8002]\n"
                      "routing: round-robin\n")
    parser = build_parser()
    argv = expand_sources(subcommand(parser, "router"), ["--config", str(config)], "KVENGINE_",
                          {"KVENGINE_ROUTING": "least-loaded", "KVENGINE_LOG_FORMAT": "json"})
    args = parser.parse_args(["router", *argv])
    assert [e.url for e in args.engines] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert args.routing == "least-loaded" and args.log_format == "json"
