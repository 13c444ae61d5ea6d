"""Fixtures for the offload tests: a tiny make-model checkpoint and real daemons."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_helpers import RunningDaemon, start_daemon

from engine.make_model import write_checkpoint


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-offload") / "model"
    write_checkpoint(out, "tiny", seed=0)
    return out


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Callable[..., RunningDaemon]]:
    """Start dedicated `kvstore serve` processes; all are stopped after the test."""
    started: list[RunningDaemon] = []

    def make(*extra: str, **kwargs) -> RunningDaemon:
        kwargs.setdefault("http", False)
        running = start_daemon(tmp_path, *extra, **kwargs)
        started.append(running)
        return running

    yield make
    for running in started:
        running.stop()
