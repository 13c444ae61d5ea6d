"""OpenAIServing: completion and chat requests into engine requests, outputs into responses."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server import responses as R
from server.async_engine import (
    AsyncEngine,
    EngineDead,
    EngineOverloaded,
    EngineRequest,
    RequestGroup,
)
from server.auth import KEY_SALT_SCOPE, tenant_salt
from server.engine_protocol import EngineOutput, ServedEngine
from server.errors import APIError
from server.metrics import ServerMetrics
from server.prompt_builder import PromptBuilder
from server.prompt_tokenizer import PromptTokenizer
from server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from server.streaming import ClientGone, EventStreamResponse, until_disconnect
from server.tokenize_pool import TokenizePool


def derive_seed(seed: int, sample_index: int) -> int:
    """Sample i of a seeded request with n > 1: sample 0 keeps `seed` (so n=1 and n>1 agree on
    it), the others get distinct seeds hashed from (seed, i). Negative seeds (allowed by the
    OpenAI API) are taken modulo 2**64, as the engine wants a non-negative one."""
    if sample_index == 0:
        return seed % 2**64
    digest = hashlib.sha256(f"kvengine-seed:{seed}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # non-negative int64


@dataclass
class _Job:
    """A prepared HTTP request: engine requests plus what the response needs."""

    response_id: str
    created: int
    arrival: float
    requests: list[EngineRequest]
    choices: dict[str, R.ChoiceState]


class OpenAIServing:
    """The request path shared by /v1/completions and /v1/chat/completions."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, model_name: str,
                 sampling_params_cls: Callable[..., Any]) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self._params_cls = sampling_params_cls
        core: ServedEngine = engine.engine
        self.max_model_len = int(core.max_model_len)
        pool = TokenizePool()
        prompt_tokenizer = PromptTokenizer(core.tokenizer,
                                           core.config.tokenizer_dir or core.config.model_dir,
                                           num_threads=pool.num_workers + 1)  # + the loop
        self.prompts = PromptBuilder(
            core.tokenizer, prompt_tokenizer, self.max_model_len, pool,
            on_overloaded=lambda: metrics.request_rejected("overloaded"))
        self.vocab_size: int | None = int(core.vocab_size) if core.vocab_size > 0 else None

    # ---- endpoints -------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        """POST /v1/completions."""
        arrival = time.perf_counter()
        self._check_common(body)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if body.logprobs is not None:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        salt = self._tenant(body, request)
        prompts = await self.prompts.completion(body.prompt, salt)
        job = self._prepare(body, salt, prompts, body.max_tokens, "prompt", "cmpl", arrival)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._stream(job, self._submit(job), include_usage, chat=False)
        choices = await self._collect(job, self._submit(job), request)
        return JSONResponse(R.completion_body(job.response_id, job.created, self.model_name,
                                              choices))

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        """POST /v1/chat/completions."""
        arrival = time.perf_counter()
        self._check_common(body)
        if body.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if body.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format type 'text' is supported",
                           param="response_format")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        salt = self._tenant(body, request)
        prompts = [await self.prompts.chat(messages, body.add_generation_prompt, salt)]
        max_tokens = body.max_completion_tokens or body.max_tokens
        job = self._prepare(body, salt, prompts, max_tokens, "messages", "chatcmpl", arrival)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._stream(job, self._submit(job), include_usage, chat=True)
        choices = await self._collect(job, self._submit(job), request)
        return JSONResponse(R.chat_body(job.response_id, job.created, self.model_name, choices))

    # ---- preparation -----------------------------------------------------------------------
    def _check_common(self, body: _SamplingFields) -> None:
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"the model `{body.model}` does not exist; this server serves "
                           f"`{self.model_name}`", param="model", code="model_not_found")
        if not self.engine.has_room(body.n):  # before tokenizing: overload should be cheap
            self.metrics.request_rejected("overloaded")
            raise APIError(503, "server is overloaded; retry later", code="overloaded")
        for name, value in (("presence_penalty", body.presence_penalty),
                            ("frequency_penalty", body.frequency_penalty)):
            if value:
                raise APIError(400, f"{name} is not supported (only 0)", param=name)
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of is not supported", param="best_of")

    @staticmethod
    def _tenant(body: _SamplingFields, request: Request) -> str:
        """The request's tenant: its API key's salt and its `cache_salt`, as the engine keys KV."""
        return tenant_salt(request.scope.get(KEY_SALT_SCOPE, ""), body.cache_salt)

    def _prepare(self, body: _SamplingFields, salt: str, prompts: list[list[int]],
                 max_tokens: int | None, prompt_param: str, id_prefix: str,
                 arrival: float) -> _Job:
        for token_ids in prompts:
            if not token_ids:
                raise APIError(400, "the prompt is empty after tokenization", param=prompt_param)
            if self.vocab_size is not None and max(token_ids) >= self.vocab_size:
                raise APIError(400, f"token id {max(token_ids)} is out of range: the vocabulary "
                               f"has {self.vocab_size} tokens", param=prompt_param)
            if len(token_ids) >= self.max_model_len:
                raise APIError(
                    400, f"this model's maximum context length is {self.max_model_len} tokens; "
                    f"the prompt has {len(token_ids)} tokens (at least one must be left to "
                    "generate)", param=prompt_param, code="context_length_exceeded")
            if max_tokens is not None and len(token_ids) + max_tokens > self.max_model_len:
                raise APIError(
                    400, f"this model's maximum context length is {self.max_model_len} tokens; "
                    f"you requested {len(token_ids) + max_tokens} tokens ({len(token_ids)} in "
                    f"the prompt, {max_tokens} to generate)", param="max_tokens",
                    code="context_length_exceeded")
        response_id = f"{id_prefix}-{uuid.uuid4().hex}"
        requests: list[EngineRequest] = []
        choices: dict[str, R.ChoiceState] = {}
        for prompt_index, token_ids in enumerate(prompts):
            for sample in range(body.n):
                index = prompt_index * body.n + sample
                request_id = f"{response_id}-{index}"
                params = self._sampling_params(body, sample, max_tokens, len(token_ids))
                requests.append(EngineRequest(request_id, token_ids, params, salt))
                choices[request_id] = R.ChoiceState(index, prompt_index, len(token_ids))
        return _Job(response_id, int(time.time()), arrival, requests, choices)

    def _sampling_params(self, body: _SamplingFields, sample: int, max_tokens: int | None,
                         num_prompt_tokens: int) -> Any:
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
        try:
            return self._params_cls(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=top_k,
                max_tokens=max_tokens or self.max_model_len - num_prompt_tokens,
                seed=None if body.seed is None else derive_seed(body.seed, sample),
                stop=body.stop,
                ignore_eos=body.ignore_eos,
            )
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    def _submit(self, job: _Job) -> RequestGroup:
        try:
            group = self.engine.submit(job.requests)
        except EngineOverloaded as exc:
            self.metrics.request_rejected("overloaded")
            raise APIError(503, str(exc), code="overloaded") from exc
        except EngineDead as exc:
            raise APIError(503, str(exc), code="engine_dead") from exc
        except ValueError as exc:  # the engine's own prompt checks
            raise APIError(400, str(exc)) from exc
        for r in job.requests:
            self.metrics.request_admitted(len(r.prompt_token_ids))
        return group

    # ---- results ---------------------------------------------------------------------------
    def _observe(self, job: _Job, out: EngineOutput) -> R.ChoiceState:
        """Fold one RequestOutput into its choice and the metrics."""
        now = time.perf_counter()
        choice = job.choices[out.request_id]
        num_new = len(out.new_token_ids)
        if num_new and choice.first_token_time is None:
            choice.first_token_time = now
            choice.num_cached_tokens = int(out.num_cached_tokens)
            choice.cached_tokens_by_tier = dict(out.cached_tokens_by_tier or {})
            self.metrics.first_token(now - job.arrival, choice.num_cached_tokens,
                                     choice.num_prompt_tokens, choice.cached_tokens_by_tier)
            self.metrics.tokens_generated(num_new, None)
        elif num_new:
            assert choice.last_token_time is not None
            self.metrics.tokens_generated(num_new, now - choice.last_token_time)
        if num_new:
            choice.last_token_time = now
        choice.num_cached_tokens = int(out.num_cached_tokens)
        choice.cached_tokens_by_tier = dict(out.cached_tokens_by_tier or {})
        choice.text = out.text
        choice.num_tokens = len(out.token_ids)
        if out.finished:
            choice.finish_reason = out.finish_reason or "stop"
            self.metrics.request_finished(choice.finish_reason, now - job.arrival)
        return choice

    def _close(self, job: _Job, group: RequestGroup) -> None:
        now = time.perf_counter()
        for request_id in group.close():
            job.choices[request_id].finish_reason = "abort"
            self.metrics.request_finished("abort", now - job.arrival)

    async def _collect(self, job: _Job, group: RequestGroup,
                       request: Request) -> list[R.ChoiceState]:
        async def drain() -> None:
            async for out in group:
                self._observe(job, out)

        try:
            await until_disconnect(drain(), request.receive)
        except ClientGone:
            return []  # nobody to answer; the finally below aborted the engine requests
        except EngineDead as exc:
            raise APIError(500, str(exc), code="engine_dead") from exc
        finally:
            self._close(job, group)
        return list(job.choices.values())

    def _stream(self, job: _Job, group: RequestGroup, include_usage: bool,
                chat: bool) -> EventStreamResponse:
        return EventStreamResponse(self._events(job, group, include_usage, chat),
                                   on_close=lambda: self._close(job, group))

    async def _events(self, job: _Job, group: RequestGroup, include_usage: bool,
                      chat: bool) -> AsyncGenerator[bytes, None]:
        rid, created, model = job.response_id, job.created, self.model_name
        try:
            if chat:  # the role first, for every choice, as OpenAI does
                for choice in sorted(job.choices.values(), key=lambda c: c.index):
                    yield R.sse(R.chat_chunk(rid, created, model, choice.index,
                                             {"role": "assistant", "content": ""}, None,
                                             include_usage))
            async for out in group:
                choice = self._observe(job, out)
                delta = choice.take_delta(final=out.finished)
                if not delta and not out.finished:
                    continue
                reason = choice.finish_reason if out.finished else None
                if chat:
                    payload = R.chat_chunk(rid, created, model, choice.index,
                                           {"content": delta} if delta else {}, reason,
                                           include_usage)
                else:
                    payload = R.completion_chunk(rid, created, model, choice.index, delta,
                                                 reason, include_usage)
                yield R.sse(payload)
            if include_usage:
                name = "chat.completion.chunk" if chat else "text_completion"
                yield R.sse(R.usage_chunk(rid, created, model, name,
                                          list(job.choices.values())))
        except EngineDead as exc:
            yield R.sse({"error": {"message": str(exc), "type": "server_error", "param": None,
                                   "code": "engine_dead"}})
        finally:
            self._close(job, group)
        yield R.SSE_DONE

