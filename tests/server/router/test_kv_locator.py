"""KVLocator, the router's bounded ``locate``, against a real daemon, a missing one and a stopped
one: an answer when there is one, else None within the bound, the state saying why, and the
daemon left alone for the retry interval."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from daemon_helpers import RunningDaemon, make_chain, start_daemon

from kvstore import StoreState
from server.router.kv_locator import KVLocator
from server.router.prompt_chain import PromptChain

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    running = start_daemon(tmp_path_factory.mktemp("locator-daemon"), dram="16MiB", http=False)
    yield running
    running.stop()


def _chain(name: str) -> PromptChain:
    chain = make_chain(name, 6, seed=7)
    return PromptChain(chain.namespace, list(chain.hashes), list(chain.idents), 16)


async def _locate(locator: KVLocator, chain: PromptChain, times: int = 1) -> list:
    return [await locator.locate(chain) for _ in range(times)]


def test_a_live_daemon_answers(daemon: RunningDaemon) -> None:
    locator = KVLocator(daemon.socket_path, timeout_s=5.0)
    try:
        replies = asyncio.run(_locate(locator, _chain("live"), times=3))
    finally:
        locator.close()
    assert [r.num_blocks for r in replies] == [6, 6, 6]
    assert locator.state is StoreState.OK


def test_no_daemon_is_down_at_once_and_skipped(tmp_path: Path) -> None:
    locator = KVLocator(tmp_path / "nobody.sock", timeout_s=5.0, retry_after_s=30.0)
    try:
        start = time.monotonic()
        assert asyncio.run(_locate(locator, _chain("down"), times=2)) == [None, None]
        assert time.monotonic() - start < 2.0  # refused at once, not after the bound
    finally:
        locator.close()
    assert locator.state is StoreState.DOWN


def test_a_stopped_daemon_costs_the_bound_then_is_skipped(daemon: RunningDaemon) -> None:
    locator = KVLocator(daemon.socket_path, timeout_s=0.05, retry_after_s=0.5)
    chain = _chain("stopped")
    try:
        assert asyncio.run(_locate(locator, chain))[0] is not None  # connected
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            assert asyncio.run(_locate(locator, chain, times=5)) == [None] * 5
            assert time.monotonic() - start < 0.5  # one bound, the rest skipped
            assert locator.state is StoreState.HUNG
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        time.sleep(0.6)  # the retry interval: asked again, on a new connection
        assert asyncio.run(_locate(locator, chain))[0] is not None
        assert locator.state is StoreState.OK
    finally:
        locator.close()
