"""OpenAIServing: completion and chat requests into engine requests, outputs into responses."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.outputs import FinishReason
from server import responses as R
from server.api_error import APIError
from server.async_engine import (
    AsyncEngine,
    EngineDead,
    EngineOverloaded,
    EngineRequest,
    RequestGroup,
)
from server.auth import KEY_SALT_SCOPE, tenant_salt
from server.chat_output import ChatShape
from server.chat_tools import ToolSettings, template_inputs, tool_request
from server.constraint_compiler import ConstraintCompiler
from server.engine_protocol import EngineOutput, ServedEngine
from server.logprobs import LogprobsFormatter
from server.metrics import ServerMetrics
from server.prompt_builder import PromptBuilder
from server.prompt_tokenizer import PromptTokenizer
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from server.reasoning_parsers import REASONING_PARSERS, reasoning_end_token
from server.request_checks import RequestChecks
from server.request_timing_log import NoTimingLog, TimingLog
from server.sampling_builder import SamplingBuilder
from server.streaming import ClientGone, EventStreamResponse, until_disconnect
from server.structured_outputs import Constraint, constraint_of
from server.tokenize_pool import TokenizePool


@dataclass
class _Job:
    """A prepared HTTP request: engine requests plus what the response needs."""

    response_id: str
    created: int
    arrival: float
    requests: list[EngineRequest]
    choices: dict[str, R.ChoiceState]
    logprobs: str | None = None  # "completion" or "chat": the shape of the `logprobs` asked for
    num_logprobs: int | None = None  # alternatives per token in `logprobs`
    formatter: LogprobsFormatter | None = None  # tokens as text, or as ids
    constraint: Constraint | None = None  # structured outputs, and the field they came from
    shape: ChatShape | None = None  # chat with tools or a reasoning parser: message parsing


class OpenAIServing:
    """The request path shared by /v1/completions and /v1/chat/completions."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, model_name: str,
                 sampling_params_cls: Callable[..., Any], tools: ToolSettings | None = None,
                 reasoning_parser: str | None = None,
                 timing_log: TimingLog | None = None) -> None:
        self.engine = engine
        self.timing_log = timing_log or NoTimingLog()  # --request-timing-log
        self.constraints = ConstraintCompiler(engine.engine)  # off the loop, once per prompt
        self.tools = tools or ToolSettings()
        self.reasoning = REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None
        self.metrics = metrics
        self.model_name = model_name
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
        self.sampling = SamplingBuilder(sampling_params_cls, self.vocab_size, self.max_model_len)
        self.checks = RequestChecks(engine, metrics, model_name, self.vocab_size,
                                    self.max_model_len)
        self._decode = core.tokenizer.decode
        self.logprobs = LogprobsFormatter(core.tokenizer.decode)
        self.logprobs_as_ids = LogprobsFormatter(core.tokenizer.decode, as_ids=True)
        # Under --reasoning-parser a chat's constraint starts after the reasoning's end token
        self.reasoning_end = reasoning_end_token(self.reasoning, core.tokenizer.encode)

    # ---- endpoints -------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        """POST /v1/completions."""
        arrival = time.perf_counter()
        self.checks.common(body)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        max_tokens = body.max_tokens
        if max_tokens == 0:  # vLLM's scoring request: generate one token, show none of it
            if not body.echo:
                raise APIError(400, "max_tokens must be at least 1, got 0 (0 only with echo: "
                               "the prompt and its logprobs, nothing generated)",
                               param="max_tokens")
            max_tokens = 1
        # As vLLM: echo with logprobs scores the prompt with as many alternatives, unless
        # prompt_logprobs says otherwise; a stream has no place for prompt_logprobs' own field
        num_prompt_logprobs = body.prompt_logprobs
        if body.echo and num_prompt_logprobs is None:
            num_prompt_logprobs = body.logprobs
        if body.stream and not (body.echo and body.logprobs is not None):
            num_prompt_logprobs = None
        salt = self._tenant(body, request)
        prompts = await self.prompts.completion(body.prompt, salt, body.add_special_tokens)
        job = self._prepare(body, salt, prompts, max_tokens, "prompt", "cmpl", arrival,
                            body.logprobs, constraint_of(body), num_prompt_logprobs)
        if body.logprobs is not None:
            job.logprobs, job.num_logprobs = "completion", body.logprobs
        if body.echo:
            self._set_echo(job, body.prompt, prompts, body.max_tokens == 0)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._stream(job, await self._submit(job), include_usage, chat=False)
        choices = await self._collect(job, await self._submit(job), request)
        return JSONResponse(R.completion_body(job.response_id, job.created, self.model_name,
                                              choices))

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        """POST /v1/chat/completions."""
        arrival = time.perf_counter()
        self.checks.common(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        tools = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls, self.tools)
        constraint = constraint_of(body)
        if tools is not None and tools.grammar is not None:
            if constraint is not None:
                raise APIError(400, f"tool_choice {body.tool_choice!r} cannot be combined with "
                               f"{constraint.param}", param=constraint.param)
            constraint = Constraint({"grammar": tools.grammar}, "tool_choice")
        if constraint is not None and self.reasoning_end is not None:  # think first, then obey
            constraint = Constraint({**constraint.spec, "reasoning_end": self.reasoning_end},
                                    constraint.param)
        messages, template_kwargs = template_inputs(
            [m.template_fields() for m in body.messages], body.chat_template_kwargs, body.tools)
        salt = self._tenant(body, request)
        prompts = [await self.prompts.chat(messages, body.add_generation_prompt, salt,
                                           template_kwargs,
                                           add_special_tokens=body.add_special_tokens)]
        max_tokens = body.max_completion_tokens or body.max_tokens
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        # a stream has no place for them (vLLM takes only 0 there, and sends nothing)
        num_prompt_logprobs = None if body.stream else body.prompt_logprobs
        job = self._prepare(body, salt, prompts, max_tokens, "messages", "chatcmpl", arrival,
                            num_logprobs, constraint, num_prompt_logprobs)
        if (tools is not None and tools.parser is not None) or self.reasoning is not None:
            job.shape = ChatShape(self.reasoning, tools and tools.parser,
                                  bool(tools and tools.named))
        if num_logprobs is not None:
            job.logprobs = "chat"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._stream(job, await self._submit(job), include_usage, chat=True)
        choices = await self._collect(job, await self._submit(job), request)
        return JSONResponse(R.chat_body(job.response_id, job.created, self.model_name, choices))

    # ---- preparation -----------------------------------------------------------------------
    @staticmethod
    def _tenant(body: SamplingFields, request: Request) -> str:
        """The request's tenant: its API key's salt and its `cache_salt`, as the engine keys KV."""
        return tenant_salt(request.scope.get(KEY_SALT_SCOPE, ""), body.cache_salt)

    def _prepare(self, body: SamplingFields, salt: str, prompts: list[list[int]],
                 max_tokens: int | None, prompt_param: str, id_prefix: str,
                 arrival: float, num_logprobs: int | None = None,
                 constraint: Constraint | None = None,
                 num_prompt_logprobs: int | None = None) -> _Job:
        if body.truncate_prompt_tokens is not None:  # vLLM's: keep the last N tokens
            keep = self.max_model_len if body.truncate_prompt_tokens == -1 \
                else body.truncate_prompt_tokens
            prompts = [token_ids[-keep:] for token_ids in prompts]
        self.checks.prompts(prompts, max_tokens, prompt_param)
        internal_id = uuid.uuid4().hex  # the engine's ids: unique whatever the client names
        response_id = f"{id_prefix}-{body.request_id or internal_id}"
        requests: list[EngineRequest] = []
        choices: dict[str, R.ChoiceState] = {}
        for prompt_index, token_ids in enumerate(prompts):
            for sample in range(body.n):
                index = prompt_index * body.n + sample
                request_id = f"{id_prefix}-{internal_id}-{index}"
                params = self.sampling.build(body, sample, max_tokens, len(token_ids),
                                             num_logprobs, constraint, num_prompt_logprobs)
                requests.append(EngineRequest(request_id, token_ids, params, salt))
                choices[request_id] = R.ChoiceState(index, prompt_index, len(token_ids))
        self.checks.logprob_volume(requests, body, max_tokens is not None,
                                   chat=prompt_param == "messages")
        formatter = self.logprobs_as_ids if body.return_tokens_as_token_ids else self.logprobs
        return _Job(response_id, int(time.time()), arrival, requests, choices,
                    formatter=formatter, constraint=constraint)

    def _set_echo(self, job: _Job, prompt: Any, prompts: list[list[int]],
                  echo_only: bool) -> None:
        """Echo: each choice's text starts with its prompt's text as the client sent it; a
        token-id prompt, or a text cut by truncate_prompt_tokens, reads as its tokens decoded
        (special tokens kept, as vLLM's detokenized prompt)."""
        texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt[0], str) \
            else None
        by_prompt: dict[int, str] = {}
        for request in job.requests:
            choice = job.choices[request.request_id]
            token_ids = request.prompt_token_ids
            text = by_prompt.get(choice.prompt_index)
            if text is None:
                if texts is not None and len(token_ids) == len(prompts[choice.prompt_index]):
                    text = texts[choice.prompt_index]
                else:
                    text = self._decode(token_ids, skip_special_tokens=False)
                by_prompt[choice.prompt_index] = text
            choice.echo_text, choice.echo_only = text, echo_only
            choice.prompt_token_ids = token_ids

    async def _submit(self, job: _Job) -> RequestGroup:
        await self.constraints.compile(job.requests, job.constraint and job.constraint.param)
        try:
            group = self.engine.submit(job.requests)
        except EngineOverloaded as exc:
            self.metrics.request_rejected("overloaded")
            raise APIError(503, str(exc), code="overloaded") from exc
        except EngineDead as exc:
            raise APIError(503, str(exc), code="engine_dead") from exc
        except ValueError as exc:  # the engine's prompt checks (constraints compiled above)
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
        if job.logprobs is not None and out.new_logprobs:
            if choice.logprobs is None:
                choice.logprobs = []
            choice.logprobs.extend(out.new_logprobs)
        if out.prompt_logprobs is not None:  # complete from the first output with a token
            choice.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            choice.finish_reason = str(out.finish_reason or FinishReason.STOP)  # a plain str
            choice.stop_reason = getattr(out, "stop_reason", None)
            self.metrics.request_finished(choice.finish_reason, now - job.arrival)
            self.timing_log.finished(job.response_id, out.request_id, choice, job.arrival, now, out)
            if choice.finish_reason == FinishReason.ERROR:  # as vLLM: a 500, or a stream's error
                raise APIError(500, "generating failed: the structured output's grammar broke "
                               "(the server's log says how)", code="generation_failed")
        return choice

    def _close(self, job: _Job, group: RequestGroup) -> None:
        now = time.perf_counter()
        for request_id in group.close():
            job.choices[request_id].finish_reason = FinishReason.ABORT.value
            self.metrics.request_finished(FinishReason.ABORT.value, now - job.arrival)
            self.timing_log.finished(job.response_id, request_id, job.choices[request_id],
                                     job.arrival, now)

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
        for request_id, choice in job.choices.items():
            if job.shape is not None:
                choice.message, choice.finish_reason = job.shape.message(
                    request_id, choice.text, choice.finish_reason)
            entries = [] if choice.echo_only else choice.logprobs or []
            if choice.echo_text is not None:  # the prompt first (vLLM's echo)
                choice.text = choice.echo_text + ("" if choice.echo_only else choice.text)
                entries = [*choice.echo_entries(), *entries]
            if job.logprobs == "chat":
                choice.logprobs_body = job.formatter.chat(entries)
            elif job.logprobs == "completion":
                choice.logprobs_body, _ = job.formatter.completion(entries, 0, job.num_logprobs)
            if choice.prompt_logprobs is not None:
                choice.prompt_logprobs_body = job.formatter.prompt_logprobs(
                    choice.prompt_logprobs)
        return list(job.choices.values())

    def _chunk_logprobs(self, job: _Job, choice: R.ChoiceState,
                        echo: bool = False) -> dict[str, Any] | None:
        """The `logprobs` of a stream chunk: the tokens not streamed yet (a chunk's text can lag
        its tokens, e.g. behind a possible stop string; their logprobs go out with it), after
        the prompt's with ``echo`` (the first chunk of an echoed choice)."""
        if job.logprobs is None:
            return None
        entries = choice.take_logprobs()
        if job.logprobs == "chat":
            return job.formatter.chat(entries)
        if choice.echo_only:
            entries = []
        if echo:
            entries = [*choice.echo_entries(), *entries]
        body, choice.logprobs_text_offset = job.formatter.completion(
            entries, choice.logprobs_text_offset, job.num_logprobs)
        return body

    def _stream(self, job: _Job, group: RequestGroup, include_usage: bool,
                chat: bool) -> EventStreamResponse:
        return EventStreamResponse(self._events(job, group, include_usage, chat),
                                   on_close=lambda: self._close(job, group))

    async def _events(self, job: _Job, group: RequestGroup, include_usage: bool,
                      chat: bool) -> AsyncGenerator[bytes, None]:
        rid, created, model = job.response_id, job.created, self.model_name
        try:
            # The role first, for every choice, as OpenAI does, with the first output (as vLLM
            # sends it): a stream's first bytes mean the prompt has been prefilled, which is
            # what a router in front counts its queue by.
            roles_due = chat
            async for out in group:
                if roles_due:
                    roles_due = False
                    for role_choice in sorted(job.choices.values(), key=lambda c: c.index):
                        yield R.sse(R.chat_chunk(rid, created, model, role_choice.index,
                                                 {"role": "assistant", "content": ""}, None,
                                                 include_usage))
                choice = self._observe(job, out)
                if chat and job.shape is not None:  # reasoning and tool calls parsed
                    for delta, reason in job.shape.chunks(out.request_id, choice.text,
                                                          out.finished, choice.finish_reason):
                        yield R.sse(R.chat_chunk(rid, created, model, choice.index, delta, reason,
                                                 include_usage, self._chunk_logprobs(job, choice),
                                                 choice.stop_reason if reason else None))
                    continue
                delta = choice.take_delta(final=out.finished)
                # echo: the first chunk carries the prompt, whatever the output holds yet
                echo_now = choice.echo_text is not None and not choice.echo_sent
                if choice.echo_only:
                    delta = ""
                if not delta and not out.finished and not echo_now:
                    continue
                reason = choice.finish_reason if out.finished else None
                stop_reason = choice.stop_reason if out.finished else None
                logprobs = self._chunk_logprobs(job, choice, echo_now)
                if echo_now:
                    choice.echo_sent = True
                    delta = choice.echo_text + delta
                if chat:
                    payload = R.chat_chunk(rid, created, model, choice.index,
                                           {"content": delta} if delta else {}, reason,
                                           include_usage, logprobs, stop_reason)
                else:
                    payload = R.completion_chunk(rid, created, model, choice.index, delta,
                                                 reason, include_usage, logprobs, stop_reason)
                yield R.sse(payload)
            if include_usage:
                name = "chat.completion.chunk" if chat else "text_completion"
                yield R.sse(R.usage_chunk(rid, created, model, name,
                                          list(job.choices.values())))
        except EngineDead as exc:
            yield R.sse({"error": {"message": str(exc), "type": "server_error", "param": None,
                                   "code": "engine_dead"}})
        except APIError as exc:  # a request that failed while it ran
            yield R.sse(exc.body())
        finally:
            self._close(job, group)
        yield R.SSE_DONE

