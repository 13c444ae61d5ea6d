"""Fixtures of the benchmark tests: the repository root importable, a tiny model, real servers."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.make_model import write_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]

START_TIMEOUT_S = 60.0


@dataclass
class EngineProcess:
    proc: subprocess.Popen
    url: str
    lines: list[str]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-bench") / "tiny"
    write_checkpoint(out, "tiny", seed=0)
    return out


def start_engine(model_dir: Path, *extra: str) -> EngineProcess:
    """`kvengine serve` on CPU on a free port, as a real subprocess; waits until it listens."""
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir), "--device",
           "cpu", "--port", "0", "--max-model-len", "1024", "--num-kv-blocks", "256", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + START_TIMEOUT_S
    for line in proc.stderr:
        lines.append(line)
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            # Keep draining stderr so a chatty server never blocks on a full pipe.
            threading.Thread(target=lines.extend, args=(proc.stderr,), daemon=True).start()
            return EngineProcess(proc, match.group(1), lines)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("kvengine serve did not start:\n" + "".join(lines))


def stop_engine(engine: EngineProcess) -> None:
    engine.proc.send_signal(signal.SIGINT)
    try:
        engine.proc.wait(20)
    except subprocess.TimeoutExpired:
        engine.proc.kill()
        engine.proc.wait(5)


@pytest.fixture
def make_engine() -> Iterator:
    """Start `kvengine serve` processes; all are stopped after the test."""
    started: list[EngineProcess] = []

    def make(model_dir: Path, *extra: str) -> EngineProcess:
        engine = start_engine(model_dir, *extra)
        started.append(engine)
        return engine

    yield make
    for engine in started:
        stop_engine(engine)
