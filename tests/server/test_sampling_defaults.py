"""SamplingDefaults over the real request models: left-out fields take the model's values, sent
fields win, and a default no request field can carry is reported, not dropped silently."""

from __future__ import annotations

import logging

import pytest

from server.protocol import ChatCompletionRequest, CompletionRequest
from server.sampling_defaults import SamplingDefaults

MODELS = (CompletionRequest, ChatCompletionRequest)


def test_left_out_fields_take_the_defaults_sent_fields_win() -> None:
    defaults = SamplingDefaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20}, MODELS)
    body = defaults.apply(CompletionRequest(prompt="x", top_p=0.5))
    assert (body.temperature, body.top_p, body.top_k) == (0.6, 0.5, 20)
    sent = CompletionRequest(prompt="x", temperature=0.0, top_p=1.0, top_k=0)
    assert defaults.apply(sent) == sent


def test_max_new_tokens_fills_a_chat_without_a_limit() -> None:
    defaults = SamplingDefaults({"max_tokens": 100}, MODELS)
    messages = [{"role": "user", "content": "hi"}]
    assert defaults.apply(ChatCompletionRequest(messages=messages)).max_tokens == 100
    limited = ChatCompletionRequest(messages=messages, max_completion_tokens=7)
    assert defaults.apply(limited).max_tokens is None  # max_completion_tokens was sent
    # /v1/completions has OpenAI's max_tokens default (16), as in vLLM: nothing is left out.
    assert defaults.apply(CompletionRequest(prompt="x")).max_tokens == 16


def test_a_default_without_a_request_field_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvengine.server"):
        defaults = SamplingDefaults({"temperature": 0.7, "no_such_field": 1.0}, MODELS)
    assert defaults.unapplied == ["no_such_field"]
    assert "no_such_field" in caplog.text and "not applied" in caplog.text
