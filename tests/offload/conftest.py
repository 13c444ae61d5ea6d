"""Fixtures for the offload tests: a small make-model checkpoint and real daemons."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_helpers import RunningDaemon, daemon_factory

from engine.make_model import write_checkpoint


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``make-model --preset small``: a checkpoint vLLM's CPU attention accepts (head dim 32)."""
    out = tmp_path_factory.mktemp("small-offload") / "model"
    write_checkpoint(out, "small", seed=0)
    return out


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Callable[..., RunningDaemon]]:
    """Start dedicated `kvstore serve` processes; all are stopped after the test."""
    with daemon_factory(tmp_path, http=False) as make:
        yield make
