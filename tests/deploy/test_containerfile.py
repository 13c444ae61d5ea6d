"""docs/deploy/container/Containerfile (issue 38 item 5): read as a builder reads it, its venv
and pip steps run in a fresh venv (the default, CPU, extras) and the two programs answer
``--help`` from there; its COPY lines carry every package the distribution installs, its
command line is the daemon's, and it runs as a non-root user. No image is built here."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from kvstore.cli.command import build_parser as kvstore_parser

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPO / "docs" / "deploy" / "container" / "Containerfile"
OFFLINE = ("NewConnectionError", "Failed to establish a new connection",
           "Temporary failure in name resolution", "Network is unreachable")


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in CONTAINERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "a continued line never ends"
    return out


def _args() -> dict[str, str]:
    """ARG defaults after FROM (the build's own values, what a plain build takes)."""
    values: dict[str, str] = {}
    for word, rest in _instructions():
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            values[name] = shlex.split(value)[0] if value else ""
    return values


def _env() -> dict[str, str]:
    values: dict[str, str] = {}
    for word, rest in _instructions():
        if word == "ENV":
            for pair in shlex.split(rest):
                name, _, value = pair.partition("=")
                values[name] = value
    return values


def _exec_form(word: str) -> list[str]:
    (rest,) = [r for w, r in _instructions() if w == word]
    return json.loads(rest)


def _package_roots() -> set[str]:
    """What the distribution installs: its packages' top folders and its modules."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    include = project["packages"]["find"]["include"]
    roots = {p.rstrip("*") for p in include}
    return roots | {f"{m}.py" for m in project["py-modules"]}


def test_copy_carries_everything_the_install_needs() -> None:
    copied = set()
    for word, rest in _instructions():
        if word == "COPY":
            *sources, dest = shlex.split(rest)
            assert dest.startswith("/src")
            copied |= set(sources)
    assert _package_roots() | {"pyproject.toml", "README.md"} <= copied


def test_it_runs_the_daemon_as_a_non_root_user() -> None:
    (user,) = [r for w, r in _instructions() if w == "USER"]
    uid = re.sub(r"\$\{(\w+)\}", lambda m: _args()[m.group(1)], user).split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    assert _exec_form("ENTRYPOINT") == ["kvstore"]
    cmd = _exec_form("CMD")
    args = kvstore_parser().parse_args(cmd)
    assert cmd[0] == "serve" and str(args.socket) == "/run/kvstore/daemon/kvstore.sock"
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    named = re.findall(r"EXTRAS=([\w,]+)", CONTAINERFILE.read_text())
    assert named and all(e in extras for n in named for e in n.split(","))


@pytest.mark.slow
def test_its_pip_steps_install_both_programs_in_a_fresh_venv(tmp_path: Path) -> None:
    """The RUN steps that make the venv and pip-install, as written (paths moved under
    tmp_path), with the default EXTRAS; then both console scripts from that venv."""
    src = tmp_path / "src"
    src.mkdir()
    for word, rest in _instructions():
        if word != "COPY":
            continue
        *sources, dest = shlex.split(rest)
        target = src / Path(dest).relative_to("/src")
        for source in sources:
            if (REPO / source).is_dir():
                shutil.copytree(REPO / source, target,
                                ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / source, target / source)
    venv_dir = _env()["VIRTUAL_ENV"]
    venv = tmp_path / "venv"
    steps = [rest for word, rest in _instructions()
             if word == "RUN" and ("pip install" in rest or "-m venv" in rest)]
    assert len(steps) == 2 and "-m venv" in steps[0], steps
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({**_args(), "VIRTUAL_ENV": str(venv),
                "PATH": f"{venv / 'bin'}{os.pathsep}{env['PATH']}"})
    for step in steps:
        command = step.replace(venv_dir, str(venv)).replace("/src", str(src))
        done = subprocess.run(["sh", "-c", command], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0 and any(s in done.stdout + done.stderr for s in OFFLINE):
            pytest.skip("no package index reachable for the install's dependencies")
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-4000:])
    assert not src.exists()  # the step cleans up after itself
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import kvstore, engine; print(kvstore.__file__, engine.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0 and all(p.startswith(str(venv)) for p in where.stdout.split())
    for program, needle in (("kvstore", "serve"), ("kvengine", "serve")):
        done = subprocess.run([str(venv / "bin" / program), "--help"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and needle in done.stdout, done.stderr
    assert (venv / "bin" / _exec_form("ENTRYPOINT")[0]).exists()
