"""One request's state as plain data: tokens, progress, blocks, hashes and output text."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from engine.detokenizer import IncrementalDetokenizer
from engine.grammar import GrammarMatcher
from engine.logprobs import TokenLogprobs
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams
from offload.vocab import TOKEN_ID_BYTES, encode_tokens


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued; no blocks (again, after a preemption)
    LOADING = "loading"  # blocks reserved, waiting for an async KV load from the store
    RUNNING = "running"  # holds blocks; scheduled every step until finished or preempted
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request inside the engine. ``token_ids`` is prompt + output; the first
    ``num_computed_tokens`` of them have their K/V in this sequence's blocks.

    ``block_hashes[j]`` keys full block ``j`` in the prefix cache (maybe truncated for collision
    tests); ``block_checks[j]`` is its full-strength chain hash, compared with the tokens on a hit.
    ``token_ids`` only ever grows (appends), so its int32-LE encoding (``token_bytes``, what block
    hashes, hit checks and store idents are made of) is converted once and extended on demand.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace_digest: bytes
    generator: np.random.Generator
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks already in the prefix cache
    block_hashes: list[bytes] = field(default_factory=list)
    block_checks: list[bytes] = field(default_factory=list)
    num_cached_tokens: int | None = None  # set at first admission
    # where those cached tokens came from ("hbm", "dram", ...), frozen with them: a preempted
    # request restored again later keeps the split it was admitted with
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    finish_reason: FinishReason | None = None
    # vLLM's stop_reason: the stop string or stop token id that ended it (None: eos or length)
    stop_reason: int | str | None = None
    num_emitted_tokens: int = 0
    num_emitted_chars: int = 0
    # The scheduler step since which it waits for its next prefill chunk (aging, see
    # engine/prefill_order.py); moved on whenever it gets tokens or (re)joins a queue.
    ready_since_step: int = 0
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # when params.logprobs
    # When params.prompt_logprobs: entry i is prompt token i's (None for the first, which
    # nothing predicts), filled chunk by chunk as prefill computes the positions before them.
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # params.structured_outputs compiled: advanced with every generated token (engine/grammar.py)
    grammar: GrammarMatcher | None = None
    # --kv-offload state (see offload/bridge.py)
    offload_checked: bool = False  # the store was asked since the last (re)admission
    abort_requested: bool = False  # aborted while a load was in flight
    num_saved_blocks: int = 0  # leading full blocks handed to the store (or known there)
    restored_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    # A prefix of token_ids as int32-LE (encode_tokens); the engine passes the prompt's, else lazy.
    token_bytes: bytes = field(default=b"", repr=False)
    # time.perf_counter() stamps for the request-phase histograms (queue, prefill, decode)
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # where a queued request waited (the timing log): the step thread took it (its store
    # lookup goes out from here), and for a restored one its restore's round trip sent, its
    # load landed and the restore ready to run (CLOCK_MONOTONIC, as perf_counter on Linux)
    taken_time: float | None = None
    restore_times: tuple[float, float, float] | None = None
    # the block manager's last prefix match: (its cache's version, num_tokens, block ids)
    prefix_match: tuple[int, int, tuple[int, ...]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        # Fixed here: outputs share ``prompt_token_ids`` with callers, who may mutate it.
        self._num_prompt_tokens = len(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]
        num_encoded, rest = divmod(len(self.token_bytes), TOKEN_ID_BYTES)
        if rest or num_encoded > len(self.token_ids):
            raise ValueError("token_bytes must encode a prefix of token_ids")

    def encoded_tokens(self, num_tokens: int) -> bytes:
        """Bytes that begin with ``token_ids[:num_tokens]`` as int32-LE (``encode_tokens``)."""
        done = len(self.token_bytes) // TOKEN_ID_BYTES
        if done < num_tokens:
            self.token_bytes += encode_tokens(self.token_ids[done:])
        return self.token_bytes

    @property
    def reads_prefix_cache(self) -> bool:
        """False while prompt logprobs are owed: those need the logits of every prompt position,
        so the prompt is computed, not taken from the HBM prefix cache or the store (vLLM skips
        prefix-cache hits for such requests too). Once they are all known (say before a
        preemption) a recompute may read cached KV again."""
        return (self.params.prompt_logprobs is None
                or len(self.prompt_logprobs) >= self._num_prompt_tokens)

    def prompt_logprob_positions(self, num_new_tokens: int) -> range:
        """The positions among the next ``num_new_tokens`` whose logits give a prompt token's
        logprob not known yet (position p predicts token p + 1; the last prompt position predicts
        the first output token, which sampling covers). Contiguous with those already known, as
        no prefix of the prompt is skipped while ``reads_prefix_cache`` is False."""
        if self.params.prompt_logprobs is None:
            return range(0)
        num_known = len(self.prompt_logprobs) - 1  # positions done
        end = min(self.num_computed_tokens + num_new_tokens, self._num_prompt_tokens - 1)
        if self.num_computed_tokens > num_known and end > num_known:
            raise RuntimeError(f"request {self.request_id!r} skipped prompt positions "
                               f"{num_known}..{self.num_computed_tokens - 1} whose logprobs "
                               "it owes")
        return range(max(self.num_computed_tokens, num_known), end)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self._num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self._num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
