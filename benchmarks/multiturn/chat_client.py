"""How the multi-turn load talks to a server: streaming chat completions, read chunk by chunk.

Two clients give the same deltas. ``HttpChatClient`` (the default) posts the JSON body itself and
reads the server-sent events line by line, as vLLM's serving benchmark does (aiohttp there, httpx
here): a TTFT timed around it is the server's and the wire's. ``OpenAIChatClient`` goes through
the OpenAI SDK, which builds each request through its typed transforms and parses every chunk
into pydantic models. On the 2-core CI VM that added 5-20 ms to each request's TTFT over the raw
client for 7-15 KB agent chats, growing with the chat's length (one request at a time, a CPU
engine; ad-hoc), so longer turns looked slower than the server made them.
"""

from __future__ import annotations

import argparse
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from server.router.proxy import ENGINE_HEADER

CLIENTS = ("http", "openai")
_MAX_ERROR_BYTES = 500


def base_url(url: str) -> str:
    """The OpenAI base URL (…/v1) of a server given with or without its /v1."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


@dataclass(frozen=True)
class Delta:
    """One step of a streamed answer: the response's engine header (the first delta, before any
    chunk), a content piece, or the usage block (any of them None when absent)."""

    content: str | None = None
    usage: dict | None = None
    engine: str | None = None


class ChatClient(ABC):
    """Streams chat completions from one OpenAI-compatible server.

    ``stream`` yields a first delta carrying the response's engine header once the server
    answered with a stream, then one delta per chunk; it raises on an HTTP error or an error
    event (the load records it). ``aclose`` ends the client's connections.
    """

    @abstractmethod
    async def first_model(self) -> str:
        """The first model the server lists."""

    @abstractmethod
    def stream(self, model: str, messages: list[dict],
               params: dict[str, Any]) -> AsyncIterator[Delta]:
        """Stream one chat completion; ``params``: the body's other fields (``extra_body``'s
        included, flat)."""

    @abstractmethod
    async def aclose(self) -> None:
        """Close the client."""


class HttpChatClient(ChatClient):
    """Raw HTTP: the body as JSON, the events as lines (``data: {...}`` until ``[DONE]``)."""

    def __init__(self, url: str, api_key: str, timeout_s: float) -> None:
        self._base = base_url(url)
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=1000),
            headers={"Authorization": f"Bearer {api_key}"})

    async def first_model(self) -> str:
        response = await self._http.get(self._base + "/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    async def stream(self, model: str, messages: list[dict],
                     params: dict[str, Any]) -> AsyncIterator[Delta]:
        body = json.dumps({"model": model, "messages": messages, "stream": True, **params})
        async with self._http.stream("POST", self._base + "/chat/completions",
                                     content=body.encode(),
                                     headers={"Content-Type": "application/json"}) as response:
            if response.status_code != 200:
                text = (await response.aread())[:_MAX_ERROR_BYTES].decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {text}")
            yield Delta(engine=response.headers.get(ENGINE_HEADER))
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if event.get("error") is not None:
                    raise RuntimeError(f"error event: {str(event['error'])[:_MAX_ERROR_BYTES]}")
                choices = event.get("choices") or []
                content = (choices[0].get("delta") or {}).get("content") if choices else None
                yield Delta(content=content or None, usage=event.get("usage"))

    async def aclose(self) -> None:
        await self._http.aclose()


class OpenAIChatClient(ChatClient):
    """The OpenAI SDK (``AsyncOpenAI``), as an application using it would see the server."""

    def __init__(self, url: str, api_key: str, timeout_s: float) -> None:
        from openai import AsyncOpenAI

        self._client = AsyncOpenAI(base_url=base_url(url), api_key=api_key, max_retries=0,
                                   timeout=timeout_s)

    async def first_model(self) -> str:
        return (await self._client.models.list()).data[0].id

    async def stream(self, model: str, messages: list[dict],
                     params: dict[str, Any]) -> AsyncIterator[Delta]:
        known = {"max_tokens", "temperature", "stream_options"}
        extra = {k: v for k, v in params.items() if k not in known}
        raw = await self._client.chat.completions.with_raw_response.create(
            model=model, messages=messages, stream=True, extra_body=extra or None,
            **{k: v for k, v in params.items() if k in known})
        yield Delta(engine=raw.headers.get(ENGINE_HEADER))
        async for chunk in raw.parse():
            content = None
            if chunk.choices and chunk.choices[0].delta:
                content = chunk.choices[0].delta.content or None
            usage = chunk.usage.model_dump() if chunk.usage is not None else None
            yield Delta(content=content, usage=usage)

    async def aclose(self) -> None:
        await self._client.close()


def make_client(kind: str, url: str, api_key: str, timeout_s: float) -> ChatClient:
    """The ``kind`` client (one of CLIENTS) for the server at ``url``."""
    if kind == "http":
        return HttpChatClient(url, api_key, timeout_s)
    if kind == "openai":
        return OpenAIChatClient(url, api_key, timeout_s)
    raise ValueError(f"client must be one of {', '.join(CLIENTS)}, not {kind!r}")


def add_client_arg(parser: argparse.ArgumentParser) -> None:
    """``--client`` (default http), as the load, the sweep, the presets and the node take it."""
    parser.add_argument("--client", choices=CLIENTS, default="http",
                        help="raw HTTP streaming (default, as vLLM's serving benchmark) or the "
                        "OpenAI SDK (its request building and chunk parsing count in TTFT)")
