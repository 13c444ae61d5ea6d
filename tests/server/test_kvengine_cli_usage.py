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

from kvstore.cli_support import DefaultsHelpFormatter, package_version
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
