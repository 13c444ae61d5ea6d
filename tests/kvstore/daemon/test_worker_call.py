"""WorkerCall: a worker thread's call awaited on the loop, bounded, never cancelled by the wait."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstore.daemon.worker_call import WorkerCall


@pytest.fixture
def executor():
    with ThreadPoolExecutor(2) as pool:
        yield pool


def test_the_result_and_the_exception_come_back(executor):
    async def main():
        assert await WorkerCall(executor, lambda a, b: a + b, 2, 3).wait(5.0) == 5
        with pytest.raises(KeyError, match="gone"):
            await WorkerCall(executor, lambda: {}["gone"]).wait(5.0)

    asyncio.run(main())


def test_a_call_done_before_the_wait_starts_is_not_waited_for(executor):
    async def main():
        call = WorkerCall(executor, lambda: "early")
        while not call.done():
            await asyncio.sleep(0.001)
        assert await call.wait(0.0) == "early"

    asyncio.run(main())


def test_a_timed_out_wait_leaves_the_call_running_and_a_later_wait_gets_it(executor):
    release = threading.Event()

    async def main():
        call = WorkerCall(executor, lambda: release.wait(5.0) and "late")
        with pytest.raises(asyncio.TimeoutError):
            await call.wait(0.05)
        assert not call.done()
        release.set()
        assert await call.wait(5.0) == "late"

    asyncio.run(main())


def test_cancelling_the_wait_does_not_cancel_the_call(executor):
    release = threading.Event()
    ended = threading.Event()

    def work():
        release.wait(5.0)
        ended.set()
        return 1

    async def main():
        call = WorkerCall(executor, work)
        waiting = asyncio.create_task(call.wait(5.0))
        await asyncio.sleep(0.02)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        seen, called = [], threading.Event()
        call.add_done_callback(lambda f: (seen.append(f.result()), called.set()))
        release.set()
        assert await call.wait(5.0) == 1
        # the caller's callback runs on the worker after the wake-up was scheduled: it may
        # still be on its way when the wait returns
        assert called.wait(5.0)
        return seen

    assert asyncio.run(main()) == [1]
    assert ended.is_set()


def test_the_task_goes_on_one_loop_turn_after_the_worker_returns(executor):
    """The point of it: no chain of futures between the worker and the waiting task."""
    async def main():
        loop = asyncio.get_running_loop()
        turns = [0]

        def tick():
            turns[0] += 1
            loop.call_soon(tick)

        gate = threading.Event()
        call = WorkerCall(executor, gate.wait, 5.0)
        waiting = asyncio.create_task(call.wait(5.0))
        await asyncio.sleep(0.01)
        marks = []

        def mark():
            marks.append(turns[0])
            loop.call_soon(tick)

        # Run by the worker right after the call's own callback scheduled the wake-up: the
        # turns count from here (a wake-up through a chain of futures takes four more).
        call.add_done_callback(lambda _: loop.call_soon_threadsafe(mark))
        gate.set()
        assert await waiting is True
        woke_at = turns[0]
        for _ in range(500):  # the mark may still be on its way from the worker
            if marks:
                break
            await asyncio.sleep(0.01)
        return marks[0], woke_at

    marked_at, woke_at = asyncio.run(main())
    assert woke_at - marked_at <= 2


def test_a_shut_down_executor_refuses_at_once():
    pool = ThreadPoolExecutor(1)
    pool.shutdown()

    async def main():
        with pytest.raises(RuntimeError, match="shutdown"):
            WorkerCall(pool, lambda: None)

    asyncio.run(main())
