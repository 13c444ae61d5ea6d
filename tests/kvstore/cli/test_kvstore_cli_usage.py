"""What a newcomer meets first on the `kvstore` command line: every option shows its default,
`--version`, a mistyped option points to the right `--help`, and a second daemon on the host
does not fail on the admin port it did not ask for."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli.args import DefaultsHelpFormatter, package_version
from kvstore.cli.command import build_parser
from kvstore.cli.serve import DEFAULT_HTTP, parse_host_port

CLI = [sys.executable, "-m", "kvstore.cli"]


def _options(parser: argparse.ArgumentParser):
    """(sub-command parser, action) of every option a sub-command takes."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                for option in sub._actions:
                    if option.option_strings and option.default is not argparse.SUPPRESS:
                        yield sub, option


def test_every_option_shows_its_default() -> None:
    missing = [(sub.prog, option.option_strings) for sub, option in _options(build_parser())
               if "default" not in (DefaultsHelpFormatter(sub.prog)._get_help_string(option)
                                    or "") and not option.required]
    assert not missing


def test_help_renders_without_rst_markup() -> None:
    for command in (["serve", "--help"], ["stats", "--help"], ["--help"], ["demo", "--help"]):
        out = subprocess.run(CLI + command, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "``" not in out.stdout and "(default: None)" not in out.stdout


def test_version() -> None:
    assert package_version() != "unknown"  # the distribution (kvstore-tiered) is installed
    out = subprocess.run(CLI + ["--version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == f"kvstore {package_version()}"


def test_a_mistyped_option_points_to_the_sub_command_help() -> None:
    out = subprocess.run(CLI + ["serve", "--drm", "1GiB"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "kvstore serve: error: unrecognized arguments: --drm 1GiB (see kvstore serve --help)"]


def _startup_lines(cmd: list[str], timeout_s: float = 60.0) -> list[str]:
    """Run a daemon until it says ready, stop it; the lines it printed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            if "kvstore: ready" in line:
                break
    finally:
        proc.terminate()
        proc.wait(timeout_s)
    return lines


def test_a_second_daemon_takes_a_free_admin_port_when_the_default_is_taken(
        tmp_path: Path) -> None:
    host, port = parse_host_port(DEFAULT_HTTP)
    with socket.socket() as holder:
        try:
            holder.bind((host, port))
            holder.listen(1)
        except OSError:
            pass  # another daemon on this machine holds it already: the same situation
        lines = _startup_lines(CLI + ["serve", "--socket", str(tmp_path / "s.sock"), "--dram",
                                      "16MiB"])
    assert any("kvstore: ready" in line for line in lines), lines
    admin = [line for line in lines if line.startswith("kvstore: admin HTTP")]
    assert admin and admin[0] != f"kvstore: admin HTTP http://{DEFAULT_HTTP}", lines
    assert any("instead" in line and "--http picks one" in line for line in lines), lines


@pytest.mark.parametrize("flag", ["--http"])
def test_an_explicit_busy_admin_port_is_an_error(tmp_path: Path, flag: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        busy = f"127.0.0.1:{holder.getsockname()[1]}"
        out = subprocess.run(CLI + ["serve", "--socket", str(tmp_path / "s.sock"), "--dram",
                                    "16MiB", flag, busy], capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 1
    assert f"cannot listen for HTTP on {busy}" in out.stderr
