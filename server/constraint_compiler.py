"""ConstraintCompiler: a request's structured-output constraint compiled off the event loop.

Attacked from outside (2026-11-28): with ``n=16`` and a 2,000-property JSON schema, ``/health``
waited 5.98 s; a ``choice`` of 20,000 strings 1.1 s. The grammar was compiled on the event loop,
under the engine's lock (so the step thread waited too), once per choice. Here it is compiled
once per distinct prompt of the request (every choice of one prompt shares the result; the
engine gives each a fresh copy), on a small pool of worker threads (llguidance releases the GIL
while it compiles), before the request reaches the engine. A constraint whose text is larger
than ``MAX_CONSTRAINT_BYTES`` is refused before any work, and one that does not compile within
``COMPILE_TIMEOUT_S`` gets a 400 that says so (its compile finishes on its worker and is
dropped; with every worker busy, later compiles queue behind it within their own bound).
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from server.api_error import APIError
from server.async_engine import EngineRequest
from server.engine_protocol import ServedEngine

# The constraint's own text: a JSON schema, a grammar, a regex, the choices together.
MAX_CONSTRAINT_BYTES = 1 << 20
COMPILE_TIMEOUT_S = 10.0
WORKERS = 2


def constraint_bytes(spec: Any) -> int:
    """The size of a ``StructuredOutputsParams``' constraint text (0 without one)."""
    if spec is None:
        return 0
    if spec.choice is not None:
        return sum(len(c.encode()) for c in spec.choice)
    return len((spec.json or spec.grammar or spec.regex or "").encode())  # json: kept as text


class ConstraintCompiler:
    """Compiles the constraints of a request's engine requests; one per server."""

    def __init__(self, engine: ServedEngine, timeout_s: float = COMPILE_TIMEOUT_S,
                 max_bytes: int = MAX_CONSTRAINT_BYTES) -> None:
        self._engine = engine
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kvengine-grammar")

    async def compile(self, requests: list[EngineRequest], param: str | None) -> None:
        """Set ``grammar`` on every request that has a constraint; APIError 400 (naming
        ``param``, the request field it came from) for one too large, too slow or invalid."""
        pending: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(requests):
            spec = r.params.structured_outputs
            if spec is None:
                continue
            size = constraint_bytes(spec)
            if size > self.max_bytes:
                raise APIError(400, f"structured_outputs: the constraint is {size} bytes, more "
                               f"than the {self.max_bytes} this server compiles", param=param)
            pending.setdefault(tuple(r.prompt_token_ids), []).append(i)
        loop = asyncio.get_running_loop()
        for indices in pending.values():
            first = requests[indices[0]]
            work = loop.run_in_executor(self._pool, self._engine.compile_grammar, first.params,
                                        first.prompt_token_ids)
            try:
                grammar = await asyncio.wait_for(work, self.timeout_s)
            except TimeoutError:
                raise APIError(400, f"structured_outputs: the constraint did not compile "
                               f"within {self.timeout_s:g} s; make it smaller or simpler",
                               param=param, code="constraint_too_complex") from None
            except ValueError as exc:
                raise APIError(400, str(exc), param=param) from exc
            for i in indices:
                requests[i] = dataclasses.replace(requests[i], grammar=grammar)

    def close(self) -> None:
        """Stop taking work; a compile running now finishes on its thread."""
        self._pool.shutdown(wait=False, cancel_futures=True)
