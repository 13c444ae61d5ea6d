"""ServerSettings: what the HTTP layer needs to know beyond the engine, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.chat_tools import ToolSettings

if TYPE_CHECKING:
    from server.sampling_defaults import SamplingDefaults

# Big enough for a 128k-token prompt as text or as token ids in JSON, far below what hurts.
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class ServerSettings:
    """Settings of the OpenAI-compatible app; the engine's own settings live in EngineConfig.

    `served_model_name` is the name clients must send as `model` (None: the engine's model name).
    `api_keys` empty means no authentication; otherwise every route except /health needs one of
    them as a Bearer token, and each key is its own cache tenant.
    `max_queue` bounds the engine requests admitted beyond `max_num_seqs`; past it the server
    answers 503. None derives it from `max_num_seqs`.
    `max_request_body_bytes`: larger request bodies get a 413 before anything parses them.
    `metrics_key`: the operator's key for /metrics. /metrics shows every tenant's traffic, so
    when `api_keys` are set it needs this key (and is refused to all while it is None); without
    API keys it is open unless a metrics key is set.
    `model_aliases`: more names requests may send as `model` (vLLM's `--served-model-name A B`);
    responses carry `served_model_name`.
    `sampling_defaults`: the model's generation_config values for fields a request leaves out.
    `tools`: --enable-auto-tool-choice and --tool-call-parser; `reasoning_parser`: the
    --reasoning-parser that splits reasoning_content off chat answers (None: off).
    `request_timing_log`: a file that gets one JSON line per finished request, with its time
    stamps (``server.request_timing_log``; None: off).
    """

    served_model_name: str | None = None
    api_keys: tuple[str, ...] = ()
    max_queue: int | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    metrics_key: str | None = None
    model_aliases: tuple[str, ...] = ()
    sampling_defaults: SamplingDefaults | None = None
    tools: ToolSettings = field(default_factory=ToolSettings)
    reasoning_parser: str | None = None
    request_timing_log: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model_aliases, str):
            raise TypeError("model_aliases must be a tuple of strings, not one string")
        if any(not name.strip() for name in self.model_aliases):
            raise ValueError("a served model name must not be blank")
        if self.model_aliases and self.served_model_name is None:
            raise ValueError("model_aliases need a served_model_name (the first name)")
        if isinstance(self.api_keys, str):
            raise TypeError("api_keys must be a tuple of strings, not one string")
        if any(not key for key in self.api_keys):
            raise ValueError("an API key must not be empty")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be blank")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got "
                             f"{self.max_request_body_bytes}")
        if self.metrics_key is not None and not self.metrics_key:
            raise ValueError("the metrics key must not be empty")
        if self.metrics_key is not None and self.metrics_key in self.api_keys:
            raise ValueError("the metrics key must differ from every API key (a tenant must "
                             "not read the other tenants' traffic)")

    def max_in_flight(self, max_num_seqs: int) -> int:
        """Engine requests admitted at once: the running batch plus the waiting queue."""
        queue = 2 * max_num_seqs if self.max_queue is None else self.max_queue
        return max_num_seqs + queue
