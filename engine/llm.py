"""The offline API: ``LLM(model_dir).generate(prompts, params)`` runs the step loop to the end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer


class LLM:
    """An engine plus a loop; extra keyword arguments go to ``EngineConfig``."""

    def __init__(
        self,
        model_dir: str,
        device: str = "auto",
        kv_offload: bool = False,
        kv_store_socket: str | None = None,
        num_kv_blocks: int | None = None,
        **config: Any,
    ) -> None:
        self.config = EngineConfig(model_dir=model_dir, device=device, kv_offload=kv_offload,
                                   kv_store_socket=kv_store_socket, num_kv_blocks=num_kv_blocks,
                                   **config)
        self.engine = LLMEngine(self.config)
        self._num_requests = 0

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str = "",
    ) -> list[RequestOutput]:
        """Final outputs in input order. A prompt is text (tokenized here) or token ids; ``params``
        is one SamplingParams for all or one per prompt (default: greedy, 16 tokens)."""
        if isinstance(prompts, str):
            raise ValueError("prompts must be a list; wrap a single prompt in [...]")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        request_ids = []
        for prompt, p in zip(prompts, params):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = f"generate-{self._num_requests}"
            self._num_requests += 1
            self.engine.add_request(request_id, ids, p, cache_salt=cache_salt)
            request_ids.append(request_id)
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(request_ids):
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    finished[out.request_id] = out
        self.engine.flush_offload()  # the last step's saves go out before we return
        return [finished[rid] for rid in request_ids]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
