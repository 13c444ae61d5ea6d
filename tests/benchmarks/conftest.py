"""Fixtures of the benchmark tests: real `kvengine serve` processes."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.kvengine import KvengineProcess


@pytest.fixture
def make_engine() -> Iterator:
    """Start `kvengine serve` processes on CPU (1,024-token context, 256 KV blocks); all are
    stopped after the test."""
    started: list[KvengineProcess] = []

    def make(model_dir: Path, *extra: str) -> KvengineProcess:
        engine = KvengineProcess("--model", str(model_dir), "--max-model-len", "1024",
                                 "--num-kv-blocks", "256", *extra, ready_timeout_s=60)
        started.append(engine)
        return engine

    yield make
    for engine in started:
        engine.stop(signal.SIGINT)
