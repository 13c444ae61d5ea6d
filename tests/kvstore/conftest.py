"""Fixtures for kvstore's tests: one shared real daemon, a factory for dedicated ones, and
engines' shared-memory arenas closed after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_helpers import RunningDaemon, daemon_factory, start_daemon
from support.arena import ShmArena


@pytest.fixture
def arenas() -> Iterator[list[ShmArena]]:
    """Append the test's arenas here: each is closed (and unlinked) after the test."""
    made: list[ShmArena] = []
    yield made
    for arena in made:
        arena.close()


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """A `kvstore serve` shared by the tests that only need a running daemon (no SSD)."""
    running = start_daemon(tmp_path_factory.mktemp("daemon"), dram="64MiB")
    yield running
    code = running.stop()
    assert code == 0, "the shared daemon did not exit cleanly:\n" + "\n".join(running.lines)


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Callable[..., RunningDaemon]]:
    """Start dedicated daemons (own flags, own SSD dir; no admin HTTP unless asked: FastAPI's
    import is half a daemon's start); all are stopped after the test."""
    with daemon_factory(tmp_path, http=False) as make:
        yield make
