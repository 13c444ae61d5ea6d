"""RequestChecks: what a completion or chat request must satisfy before it reaches the engine,
each refusal a 400 (404 for another model, 503 for no room) in the OpenAI error shape with
vLLM's wording where vLLM has one."""

from __future__ import annotations

from collections.abc import Sequence

from engine.sampling_params import MAX_LOGPROBS
from server.api_error import APIError
from server.async_engine import AsyncEngine, EngineRequest
from server.metrics import ServerMetrics
from server.protocol import PASSTHROUGH_FIELDS, SamplingFields

# Logprob entries (a token, or one of its alternatives) a request may be answered with: each costs
# about 1.5 KB of the server's memory until its response is written (n=128 echoing 1,000-token
# prompts with 20 alternatives took 4 GB for one 520 MB response). 1M fits a 40k-token prompt's
# prompt_logprobs with 20 alternatives, or lm-eval's scoring of any prompt.
MAX_LOGPROB_ENTRIES = 1_000_000


def logprob_entries(requests: Sequence[EngineRequest], count_generated: bool = True
                    ) -> tuple[int, int]:
    """The logprob entries ``requests`` can be answered with, at most, as (prompt, generated):
    per prompt token ``prompt_logprobs + 1``, per generated token ``logprobs + 1``."""
    prompt = generated = 0
    for r in requests:
        params = r.params
        if params.prompt_logprobs is not None:
            prompt += len(r.prompt_token_ids) * (params.prompt_logprobs + 1)
        if params.logprobs is not None and count_generated:
            generated += (params.max_tokens or 0) * (params.logprobs + 1)
    return prompt, generated


class RequestChecks:
    """The served model's bounds: its name, vocabulary and context length."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, model_name: str,
                 vocab_size: int | None, max_model_len: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def common(self, body: SamplingFields) -> None:
        """What every generation request is checked for before its prompt is tokenized: the
        model, room in the engine (an overload costs little), fields kvengine does not do."""
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"the model `{body.model}` does not exist; this server serves "
                           f"`{self.model_name}`", param="model", code="model_not_found")
        too_many = self.engine.never_fits(body.n)
        if too_many:
            raise APIError(400, too_many, param="n")
        if not self.engine.has_room(body.n):  # before tokenizing: overload should be cheap
            self.metrics.request_rejected("overloaded")
            raise APIError(503, "server is overloaded; retry later", code="overloaded")
        unsupported = body.unsupported_fields()
        if unsupported:
            raise APIError(
                400, f"unsupported request field(s): {', '.join(unsupported)}. kvengine does not "
                "implement them and will not silently ignore them (accepted without effect: "
                f"{', '.join(sorted(PASSTHROUGH_FIELDS))})", param=unsupported[0],
                code="unsupported_parameter")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of is not supported", param="best_of")
        if body.priority != 0:
            raise APIError(400, "priority scheduling is not enabled: kvengine serves requests "
                           "first come, first served (priority 0)", param="priority")
        self.prompt_logprobs(body)

    def prompt_logprobs(self, body: SamplingFields) -> None:
        """vLLM 0.32's bounds on `prompt_logprobs`, with its messages: -1 (the whole vocabulary)
        or more than --max-logprobs are refused, and a stream takes only 0."""
        num = body.prompt_logprobs
        if num is None:
            return
        if num < -1:
            raise APIError(400, "`prompt_logprobs` must be a positive value or -1.",
                           param="prompt_logprobs")
        if body.stream and num != 0:
            raise APIError(400, "`prompt_logprobs` are not available when `stream=True`.",
                           param="prompt_logprobs")
        if num == -1 or num > MAX_LOGPROBS:
            requested = num if num != -1 else (self.vocab_size or num)
            raise APIError(400, f"Requested prompt logprobs of {requested}, which is greater "
                           f"than max allowed: {MAX_LOGPROBS}", param="prompt_logprobs")

    def prompts(self, prompts: list[list[int]], max_tokens: int | None,
                prompt_param: str) -> None:
        """Each tokenized prompt: not empty, in the vocabulary, with room to generate."""
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

    def logprob_volume(self, requests: Sequence[EngineRequest], body: SamplingFields,
                       max_tokens_given: bool, chat: bool) -> None:
        """400 unless the answer's logprobs stay within ``MAX_LOGPROB_ENTRIES``. A stream holds
        none of them; generated tokens count only up to a ``max_tokens`` the client set (else
        a plain ``logprobs`` request on a long-context model would count its whole context)."""
        if getattr(body, "stream", False):
            return
        prompt, generated = logprob_entries(requests, count_generated=max_tokens_given)
        if prompt + generated <= MAX_LOGPROB_ENTRIES:
            return
        param = "prompt_logprobs" if prompt >= generated and body.prompt_logprobs is not None \
            else "top_logprobs" if chat else "logprobs"
        raise APIError(400, f"this request could be answered with {prompt + generated} logprob "
                       f"entries (n x (prompt tokens x (prompt_logprobs + 1) + max_tokens x "
                       f"(logprobs + 1))); at most {MAX_LOGPROB_ENTRIES} are served in one "
                       "answer: ask fewer alternatives, a smaller n or fewer tokens, or stream",
                       param=param)
