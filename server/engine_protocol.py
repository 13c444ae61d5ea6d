"""ServedEngine: exactly what the HTTP server needs from the engine, as typed protocols.

The server never probes the engine with `getattr`; it calls what is named here, and
`engine.LLMEngine` satisfies it structurally. A second engine (a remote one, a test double of an
outside system) only has to provide these members to be served.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from kvstore import StoreState

if TYPE_CHECKING:
    from engine import SamplingParams

# where a served engine reports its load (server/load_report.py) and the router reads it
LOAD_PATH = "/load"


class PromptCodec(Protocol):
    """The engine's tokenizer as the server uses it: text in, token ids out."""

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the post-processor adds (BOS)."""
        ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids`; special tokens dropped unless `skip_special_tokens` is False."""
        ...

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each id's vocabulary entry (as transformers' convert_ids_to_tokens)."""
        ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text of a conversation; `kwargs` are template variables
        (`chat_template_kwargs`). Raises for a conversation the template refuses."""
        ...


class EngineSettingsView(Protocol):
    """The parts of the engine's configuration the server reads."""

    @property
    def model_dir(self) -> str: ...

    @property
    def tokenizer_dir(self) -> str | None:
        """The tokenizer's folder when it is not the model's (--tokenizer)."""
        ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def enable_prefix_caching(self) -> bool: ...

    @property
    def gpu_memory_utilization(self) -> float: ...

    @property
    def kv_offload(self) -> bool: ...

    @property
    def kv_offload_policy(self) -> str: ...


class KernelsView(Protocol):
    """The engine's kernel backend as /metrics reads it."""

    kv_dtype: str
    num_attention_fallbacks: int  # attention calls the chosen backend refused (ours served them)

    @property
    def builds(self) -> BuildsView:
        """Graph captures and cuDNN builds, before and after the engine said ready."""
        ...

    @property
    def allocator_bytes(self) -> dict[str, int]:
        """The device allocator's ``held`` and ``in_use`` bytes; empty on host backends."""
        ...


class BuildsView(Protocol):
    """What a kernel backend built (``kernels/build_log.py``) as /metrics reads it."""

    def snapshot(self) -> dict:
        """``{"before": {kind: n}, "after": {kind: n}, ...}``."""
        ...


class RunnerView(Protocol):
    """The engine's model runner as /metrics reads it."""

    @property
    def attention_backend(self) -> str:
        """``prefill=NAME decode=NAME`` (each "reference", "ours" or "cudnn")."""
        ...

    @property
    def ops(self) -> KernelsView: ...


class EngineOutput(Protocol):
    """One request's state after a step: cumulative tokens and text plus this step's delta."""

    request_id: str
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # once finished: engine.outputs.FinishReason (a str) or its value
    stop_reason: int | str | None  # once finished: the stop string or token id (vLLM's)
    num_cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    new_logprobs: Sequence[Any] | None  # per new token (server/logprobs.TokenLogprobsView)
    # when asked (params.prompt_logprobs): per prompt token, None for the first
    prompt_logprobs: Sequence[Any] | None
    prompt_token_ids: list[int]
    # time.perf_counter() stamps: added to the engine, first in a batch, first token, this output
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    output_time: float
    # the engine's thread took it; a restore's (sent, landed, ready) stamps, where restored
    taken_time: float | None
    restore_times: tuple[float, float, float] | None


class OffloadStats(TypedDict, total=False):
    """The engine's `--kv-offload` counters; `store_state` is a `StoreState` value where the
    offload layer reports it. Other keys are counters (ints) or nested dicts of them."""

    store_state: str
    connector: dict[str, Any]


class EngineStats(TypedDict, total=False):
    """A snapshot of the engine's counters as of its last step (`ServedEngine.stats()`)."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_blocks_in_use: int
    prefix_cache_queries: int  # prompt tokens looked up (each request once)
    prefix_cache_hits: int  # of them, served by this engine's own prefix cache
    prefix_cache_hit_tokens: dict[str, int]  # by tier: own cache and the store's tiers
    num_preemptions: int
    kv_offload: OffloadStats | None


class ServedEngine(Protocol):
    """An engine the server can serve. Threading contract: `add_request`, `abort_request`,
    `has_unfinished_requests` and `stats` are safe from any thread; `step`, `flush_offload`,
    `use_idle_time` and `close` run on one thread (the server's step thread, then the owner at
    shutdown)."""

    model_name: str
    max_model_len: int
    device: str
    tokenizer: PromptCodec
    runner: RunnerView

    @property
    def config(self) -> EngineSettingsView: ...

    @property
    def vocab_size(self) -> int:
        """Prompt token ids must be below this."""
        ...

    def compile_grammar(self, params: SamplingParams, prompt_token_ids: list[int]) -> Any:
        """``params``' structured-output constraint compiled for this prompt (None without
        one), for ``add_request``; slow (up to seconds) and thread-safe: call it off the loop.
        ValueError for a constraint that does not compile."""
        ...

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, cache_salt: str = "", grammar: Any = None) -> None:
        """Queue a request (generate/stream: its outputs come from `step`); ValueError for a
        prompt or params the engine refuses. ``grammar``: ``compile_grammar``'s result (else
        the engine compiles it here)."""
        ...

    def abort_request(self, request_id: str) -> None:
        """Cancel: the request ends with reason "abort" at the next step; unknown ids ignored."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> Sequence[EngineOutput]:
        """Run one scheduling step; outputs of the requests that got a token or ended."""
        ...

    def flush_offload(self) -> None:
        """The store work the last step left for after its outputs (a no-op without offload)."""
        ...

    def use_idle_time(self) -> None:
        """No request is left: do what the engine leaves for idle time (graphs built in the
        background loaded), returning soon after a request arrives."""
        ...

    def stats(self) -> EngineStats:
        """Counters as of the last step (a copy)."""
        ...

    def close(self) -> None: ...


def offload_stats(snapshot: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The offload part of a stats snapshot, or None when the engine runs without offload."""
    offload = snapshot.get("kv_offload")
    return offload if isinstance(offload, Mapping) else None


def kv_store_state(snapshot: Mapping[str, Any]) -> StoreState | None:
    """The store's state (ok, hung or down) as the offload layer reports it; None without
    offload or when the offload layer does not report a state (or one this server does not
    know)."""
    offload = offload_stats(snapshot)
    if offload is None:
        return None
    state = offload.get("store_state")
    if state is None and isinstance(offload.get("connector"), Mapping):
        state = offload["connector"].get("store_state")
    try:
        return StoreState(state)
    except ValueError:
        return None
