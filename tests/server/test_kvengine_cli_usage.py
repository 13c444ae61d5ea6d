"""What a newcomer meets first on the `kvengine` command line: every option shows its default,
`--version`, a mistyped option points to the right `--help`, a busy port fails before the model
loads."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvstore.cli.args import DefaultsHelpFormatter, package_version
from server.cli import build_parser

CLI = [sys.executable, "-m", "server.cli"]


def test_every_serve_option_shows_its_default() -> None:
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    serve = commands.choices["serve"]
    missing = [option.option_strings for option in serve._actions
               if option.option_strings and option.default is not argparse.SUPPRESS
               and not option.required
               and "default" not in (DefaultsHelpFormatter(serve.prog)._get_help_string(option)
                                     or "")]
    assert not missing


def test_help_renders_without_rst_markup() -> None:
    for command in (["serve", "--help"], ["make-model", "--help"], ["--help"]):
        out = subprocess.run(CLI + command, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "``" not in out.stdout and "(default: None)" not in out.stdout


def test_version() -> None:
    out = subprocess.run(CLI + ["--version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == f"kvengine {package_version()}"


def test_a_mistyped_option_points_to_the_serve_help(tiny_model_dir: Path) -> None:
    out = subprocess.run(CLI + ["serve", "--model", str(tiny_model_dir), "--prot", "8000"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "kvengine serve: error: unrecognized arguments: --prot 8000 "
        "(see kvengine serve --help)"]


def test_a_busy_port_fails_before_the_model_loads(tiny_model_dir: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        started = time.monotonic()
        out = subprocess.run(CLI + ["serve", "--model", str(tiny_model_dir), "--device", "cpu",
                                    "--port", str(port)], capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines == [f"kvengine: error: cannot listen on 127.0.0.1:{port}: "
                     "Address already in use"], lines
    assert time.monotonic() - started < 20


def test_the_prefill_scheduling_options_reach_the_engine_config(tiny_model_dir: Path) -> None:
    from server.cli import _engine_config

    args = build_parser().parse_args(
        ["serve", "--model", str(tiny_model_dir), "--prefill-order", "fcfs",
         "--max-prefill-wait-steps", "0", "--latency-chunk-tokens", "256"])
    config = _engine_config(args, tiny_model_dir, None)
    assert (config.prefill_order, config.max_prefill_wait_steps,
            config.latency_chunk_tokens) == ("fcfs", 0, 256)
    defaults = _engine_config(build_parser().parse_args(
        ["serve", "--model", str(tiny_model_dir)]), tiny_model_dir, None)
    assert (defaults.prefill_order, defaults.max_prefill_wait_steps,
            defaults.latency_chunk_tokens) == ("shortest-first", 4, None)


def test_bad_prefill_scheduling_options_are_refused_in_one_line(tiny_model_dir: Path) -> None:
    for bad in (["--latency-chunk-tokens", "0"], ["--latency-chunk-tokens", "x"],
                ["--max-prefill-wait-steps", "-1"], ["--prefill-order", "random"],
                ["--max-prefill-graph-tokens", "8"], ["--max-prefill-graph-tokens", "1k"]):
        out = subprocess.run(CLI + ["serve", "--model", str(tiny_model_dir), *bad],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 2, bad
        assert "error: argument " + bad[0] in out.stderr, out.stderr


def test_an_unwritable_request_timing_log_fails_before_the_model_loads(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "no-such-folder" / "timing.jsonl"
    out = subprocess.run(CLI + ["serve", "--model", str(tiny_model_dir), "--device", "cpu",
                                "--port", "0", "--request-timing-log", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"kvengine: error: --request-timing-log {path}: No such file or directory "
        "(see kvengine --help)")
