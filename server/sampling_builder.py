"""SamplingBuilder: a request's sampling fields as the engine's SamplingParams, one per sample.

OpenAI's defaults where a field is absent (temperature and top_p 1, every token to the context
limit), vLLM's spellings where OpenAI has none (top_k, min_p, stop_token_ids, ...), token ids
checked against the vocabulary, and a distinct seed per sample of a seeded ``n > 1`` request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from server.api_error import APIError
from server.protocol import SamplingFields
from server.structured_outputs import Constraint


def derive_seed(seed: int, sample_index: int) -> int:
    """Sample i of a seeded request with n > 1: sample 0 keeps `seed` (so n=1 and n>1 agree on
    it), the others get distinct seeds hashed from (seed, i). Negative seeds (allowed by the
    OpenAI API) are taken modulo 2**64, as the engine wants a non-negative one."""
    if sample_index == 0:
        return seed % 2**64
    digest = hashlib.sha256(f"kvengine-seed:{seed}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # non-negative int64


class SamplingBuilder:
    """Builds SamplingParams (``params_cls``) for one served model."""

    def __init__(self, params_cls: Callable[..., Any], vocab_size: int | None,
                 max_model_len: int) -> None:
        self._params_cls = params_cls
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def build(self, body: SamplingFields, sample: int, max_tokens: int | None,
              num_prompt_tokens: int, num_logprobs: int | None,
              constraint: Constraint | None = None,
              num_prompt_logprobs: int | None = None) -> Any:
        """The engine's SamplingParams for sample ``sample`` of ``body`` (APIError 400 on a
        value the engine refuses, naming the field)."""
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
        bias = {int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None
        if bias and self.vocab_size is not None and max(bias) >= self.vocab_size:
            raise APIError(400, f"logit_bias names token id {max(bias)}, out of range: the "
                           f"vocabulary has {self.vocab_size} tokens", param="logit_bias")
        stop_ids = body.stop_token_ids
        if stop_ids and self.vocab_size is not None and max(stop_ids) >= self.vocab_size:
            raise APIError(400, f"stop_token_ids names token id {max(stop_ids)}, out of range: "
                           f"the vocabulary has {self.vocab_size} tokens",
                           param="stop_token_ids")
        try:
            return self._params_cls(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=top_k,
                max_tokens=max_tokens or self.max_model_len - num_prompt_tokens,
                seed=None if body.seed is None else derive_seed(body.seed, sample),
                stop=body.stop,
                ignore_eos=body.ignore_eos,
                min_p=body.min_p or 0.0,
                repetition_penalty=(1.0 if body.repetition_penalty is None
                                    else body.repetition_penalty),
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                logit_bias=bias,
                min_tokens=body.min_tokens,
                stop_token_ids=stop_ids,
                logprobs=num_logprobs,
                prompt_logprobs=num_prompt_logprobs,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                structured_outputs=None if constraint is None else constraint.spec,
            )
        except ValueError as exc:  # the engine's checks name the field first
            field = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), param=field if field in type(body).model_fields else None,
                           code="invalid_value") from exc
