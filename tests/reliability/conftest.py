"""Fixtures for the reliability tests: real daemons and guarded arenas, all cleaned up."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_helpers import RunningDaemon, daemon_factory
from reliability_helpers import guarded_arena
from support.arena import ShmArena

# schemathesis comes with the `test` extra (CI has it); the GPU machine runs `-m gpu` without it.
collect_ignore = [] if importlib.util.find_spec("schemathesis") else ["test_http_schema.py"]


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Callable[..., RunningDaemon]]:
    """Dedicated `kvstore serve` processes (no admin HTTP unless asked), stopped after the test."""
    with daemon_factory(tmp_path, http=False) as make:
        yield make


@pytest.fixture
def arenas() -> Iterator[Callable[..., ShmArena]]:
    """Guarded shared-memory arenas, unlinked after the test (also when a client was killed)."""
    made: list[ShmArena] = []

    def make(num_blocks: int, block_bytes: int, seed: int | None) -> ShmArena:
        arena = guarded_arena(num_blocks, block_bytes, seed)
        made.append(arena)
        return arena

    yield make
    for arena in made:
        arena.close()
