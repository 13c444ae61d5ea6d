"""Disconnect-aware responses: a client that goes away cancels the work done for it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the response was complete."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """Await `work`, cancelling it (so its `finally` runs) if the client disconnects first.

    Call after the request body has been read: `receive` then only reports the disconnect.
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch_task
    if work_task.cancelled() or not work_task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await work_task
        raise ClientGone()
    return work_task.result()


class EventStreamResponse(Response):
    """Server-sent events from an async generator of already-framed `data: ...\\n\\n` chunks.

    Unlike Starlette's StreamingResponse (which, under ASGI 2.4, only notices a disconnect at
    the next write), this watches `receive` the whole time and cancels the iterator at once, so a
    request still waiting for its first token is aborted too. The iterator is always closed and
    `on_close` always called, even when the client left before the first chunk.
    """

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncGenerator[bytes, None],
                 on_close: Callable[[], None] | None = None, status_code: int = 200) -> None:
        self._chunks = chunks
        self._on_close = on_close
        self.status_code = status_code
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    def mapped(self, transform: Callable[[AsyncGenerator[bytes, None]],
                                         AsyncGenerator[bytes, None]]) -> EventStreamResponse:
        """The same stream, its chunks rewritten by ``transform`` (which closes them when it
        ends); the same ``on_close``."""
        return EventStreamResponse(transform(self._chunks), self._on_close, self.status_code)

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for chunk in self._chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watch):
                task.cancel()
            for task in (pump, watch):
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
            await self._chunks.aclose()
            if self._on_close is not None:  # runs even if the iterator never started
                self._on_close()
