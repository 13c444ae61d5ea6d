"""What the engine hands back for a request after a step: cumulative state plus the delta."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.logprobs import TokenLogprobs
from offload.vocab import Tier

TIERS = tuple(t.value for t in Tier)  # hbm: this engine's own; hbm_peer: another's


class FinishReason(str, enum.Enum):
    """Why a request ended: vLLM's reasons, less "repetition". A ``str``, so it compares equal
    to its value and is written as it (JSON, metrics' labels, logs)."""

    STOP = "stop"  # eos, a stop token or a stop string, or a structured output complete
    LENGTH = "length"  # max_tokens or the model length
    ABORT = "abort"  # the client went away, or the engine was asked to end it
    ERROR = "error"  # its structured output's grammar failed: the answer is cut, as vLLM's

    def __str__(self) -> str:
        return self.value


def empty_tier_counts() -> dict[str, int]:
    return dict.fromkeys(TIERS, 0)


def prefix_source(cached_tokens_by_tier: dict[str, int]) -> str:
    """Where a prompt's cached prefix came from: ``restored`` (some of it from the store, or
    another engine's HBM), ``hbm_hit`` (this engine's HBM only) or ``cold`` (nothing)."""
    if any(n for tier, n in cached_tokens_by_tier.items() if tier != "hbm"):
        return "restored"
    return "hbm_hit" if cached_tokens_by_tier.get("hbm") else "cold"


@dataclass
class RequestOutput:
    """``token_ids``/``text`` are everything generated so far; ``new_*`` what this step added.

    ``finish_reason`` is None until ``finished``, then a ``FinishReason``.
    ``num_cached_tokens`` prompt tokens were served from cache instead of computed, split by
    where they came from in ``cached_tokens_by_tier``.
    ``prompt_token_ids`` is one list shared by all of a request's outputs (not copied per step):
    read it, do not mutate it. ``logprobs`` (requests with ``params.logprobs``) has one entry per
    generated token; it is the request's own list, growing while it runs (read, do not mutate);
    ``new_logprobs`` the entries of ``new_token_ids``. ``prompt_logprobs`` (requests with
    ``params.prompt_logprobs``, vLLM's shape) has one entry per prompt token, None for the first;
    complete from the first output with a token on (also the request's own list).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    num_cached_tokens: int
    cached_tokens_by_tier: dict[str, int] = field(default_factory=empty_tier_counts)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # time.perf_counter() stamps: added to the engine, first in a batch, first token, this output
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    output_time: float = 0.0
    # the step thread took it; a restore's (sent, landed, ready) (``Sequence``'s)
    taken_time: float | None = None
    restore_times: tuple[float, float, float] | None = None
    # Once finished by "stop": the stop string or stop token id that ended it, None for eos
    # (vLLM's stop_reason).
    stop_reason: int | str | None = None
