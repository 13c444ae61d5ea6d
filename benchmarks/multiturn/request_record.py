"""One multi-turn benchmark request's record (``benchmarks.multiturn.load`` fills it,
``benchmarks.multiturn.summary`` reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """What one request did; times in seconds, `*_s` relative to the start of the run."""

    user: int
    round: int
    scheduled_s: float
    sent_s: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cached_tokens_by_tier: dict[str, int] | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    num_chunks: int = 0
    error: str | None = None
    engine: str | None = None  # the engine that served it, where a router names it
    request_id: str | None = None  # sent as the body's request_id (the response id carries it)
    sent_clock_s: float | None = None  # time.perf_counter() at the send (the host's clock)
    server: dict[str, float] | None = None  # ms per phase, from the server's timing log

    @property
    def ok(self) -> bool:
        return self.error is None
