"""How to pick each next token and when to stop: validated once, immutable."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from engine.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI and vLLM's default allow
MAX_LOGIT_BIAS = 100.0  # |bias| bound, as in the OpenAI API
# Stop strings are searched for after every token, in the step thread that serves every request:
# their number and size are bounded so one request cannot slow the others' steps (TGI bounds
# the count too; vLLM does not). Far above what a chat template or a code model needs.
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 16_384  # all of a request's stop strings together
# logit_bias entries and stop_token_ids: each is validated in Python before the request runs,
# on the server's event loop (300,000 logit_bias entries held every other request 0.8 s).
MAX_TOKEN_ID_ITEMS = 20_000
# repetition_penalty bounds: far beyond any useful value, and in float32 a logit divided or
# multiplied by them stays finite (a penalty that rounds to 0 would make inf and NaN).
REPETITION_PENALTY_RANGE = (1e-3, 1e3)


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 is greedy. ``top_k`` 0 and ``top_p`` 1.0 switch those filters off.

    ``max_tokens`` None means: until the model length runs out. ``stop`` (a string or a list of
    strings) ends generation at the first occurrence and trims it from the text (kept with
    ``include_stop_str_in_output``). ``seed`` fixes the request's own random stream, whatever else
    is batched with it.

    vLLM's extras, with vLLM's meaning: ``min_p`` drops tokens less likely than ``min_p`` times
    the most likely one (after temperature); ``repetition_penalty`` (1.0 = off) divides the
    positive logits and multiplies the negative ones of every token in the prompt or the output;
    ``presence_penalty`` / ``frequency_penalty`` (OpenAI's) subtract once per token that occurs in
    the output / once per occurrence; ``logit_bias`` adds to the logits of the given ids;
    ``min_tokens`` forbids eos and ``stop_token_ids`` (and ignores stop strings) until that many
    tokens were generated; ``stop_token_ids`` end generation like eos (the token stays in
    ``token_ids``, its text is only shown with ``include_stop_str_in_output``);
    ``logprobs`` N returns, per generated token, its log-probability and the N most likely
    alternatives (0: the token only), computed from the model's raw logits (vLLM's default
    ``raw_logprobs``: before penalties, bias and temperature); ``prompt_logprobs`` N the same for
    every prompt token after the first (vLLM's: such a request computes its whole prompt, it
    reads no cached KV); ``skip_special_tokens`` False keeps special tokens in the text. Greedy
    rows get the penalties, bias and ``min_tokens`` too.

    ``structured_outputs`` (vLLM's name; a ``StructuredOutputsParams`` or a mapping of its
    fields, e.g. ``{"json": schema}``) constrains the output to a JSON schema, any JSON object,
    a regex, one of some strings or a grammar: tokens the grammar refuses are never sampled, eos
    only once it accepts, and the request ends when nothing more can follow.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not _is_number(p) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer or None, "
                             f"got {self.max_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        self._check_vllm_extras()

    def _check_vllm_extras(self) -> None:
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        r, (low, high) = self.repetition_penalty, REPETITION_PENALTY_RANGE
        if not _is_number(r) or not low <= r <= high:
            raise ValueError(f"repetition_penalty must be in [{low:g}, {high:g}] (1 = off), "
                             f"got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                             f"({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, "
                                 f"got {value!r}")
        object.__setattr__(self, "stop_token_ids", _normalize_ids(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _normalize_bias(self.logit_bias))
        object.__setattr__(self, "structured_outputs",
                           StructuredOutputsParams.from_value(self.structured_outputs))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """True when the logits change before sampling (penalties, bias, min_tokens, min_p)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias)
                or self.min_tokens > 0 or (self.min_p > 0.0 and not self.greedy))

    def max_token_id(self) -> int:
        """The largest token id the params name (-1 if none): the engine checks it against the
        vocabulary."""
        ids = list(self.stop_token_ids or ()) + list(self.logit_bias or ())
        return max(ids, default=-1)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _normalize_stop(stop: object) -> tuple[str, ...] | None:
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}")
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
    check_stop_budget(items)
    return tuple(items) or None


def check_stop_budget(items: Sequence[str]) -> None:
    """ValueError unless ``items`` (stop strings) fit ``MAX_STOP_STRINGS`` and
    ``MAX_STOP_CHARS``."""
    if len(items) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings per request, got {len(items)}")
    num_chars = sum(len(s) for s in items)
    if num_chars > MAX_STOP_CHARS:
        raise ValueError(f"stop strings may hold at most {MAX_STOP_CHARS} characters in all, "
                         f"got {num_chars}")


def check_token_id_items(name: str, count: int) -> None:
    """ValueError when ``name`` (``logit_bias`` or ``stop_token_ids``) has more than
    ``MAX_TOKEN_ID_ITEMS`` entries."""
    if count > MAX_TOKEN_ID_ITEMS:
        raise ValueError(f"at most {MAX_TOKEN_ID_ITEMS} {name} entries, got {count}")


def _normalize_ids(ids: object) -> tuple[int, ...] | None:
    if ids is None:
        return None
    if isinstance(ids, (list, tuple)):
        check_token_id_items("stop_token_ids", len(ids))
    if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
        raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {ids!r}")
    return tuple(dict.fromkeys(ids)) or None


def _normalize_bias(bias: object) -> Mapping[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
    check_token_id_items("logit_bias", len(bias))
    out: dict[int, float] = {}
    for token_id, value in bias.items():
        if not _is_int(token_id) or token_id < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
        if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}], got {value!r} for token {token_id}")
        out[int(token_id)] = float(value)
    return MappingProxyType(out) if out else None  # read-only, as the rest of the params
