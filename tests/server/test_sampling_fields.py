"""vLLM's sampling fields, logprobs and chat_template_kwargs through a real server and clients.

What each field computes is proven against references in tests/engine; here: the HTTP request
reaches the engine with the same meaning (the offline engine on the same model gives the same
tokens), logprobs come back in OpenAI's shapes (streamed the same as not), and any field we do
not implement is a 400, never silently ignored.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from server_helpers import start_server, stop_server

from engine import LLM, SamplingParams
from engine.chat_template import ChatTemplate

PROMPT = "The tiered cache keeps blocks of keys and values"
TEMPLATES = Path(__file__).parents[1] / "engine" / "data" / "chat_templates"


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path):
    with LLM(str(tiny_model_dir), device="cpu") as llm:
        yield llm


def _events(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _error(response: httpx.Response, param: str | None) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"] or "").split(".")[0] == param  # e.g. stop_token_ids.0
    return error


def test_sampling_fields_reach_the_engine_with_their_meaning(http: httpx.Client, offline: LLM
                                                             ) -> None:
    ids = offline.tokenizer.encode(PROMPT)
    plain = offline.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    fields = {"repetition_penalty": 1.6, "presence_penalty": 0.8, "frequency_penalty": 0.4,
              "min_tokens": 3, "logit_bias": {str(plain.token_ids[0]): -50.0, "7": 1.5},
              "stop_token_ids": [plain.token_ids[5]], "min_p": 0.2, "ignore_eos": True}
    params = SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.6,
                            presence_penalty=0.8, frequency_penalty=0.4, min_tokens=3,
                            logit_bias={plain.token_ids[0]: -50.0, 7: 1.5},
                            stop_token_ids=[plain.token_ids[5]], min_p=0.2)
    want = offline.generate([ids], params)[0]
    assert want.token_ids != plain.token_ids
    body = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12,
                                              "temperature": 0.0, **fields}).json()
    assert body["choices"][0]["text"] == want.text
    assert body["usage"]["completion_tokens"] == len(want.token_ids)
    stop = plain.text[4:7]
    kept = offline.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop],
                                                  include_stop_str_in_output=True))[0]
    assert kept.text.endswith(stop)
    body = http.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
        "stop": [stop], "include_stop_str_in_output": True}).json()
    assert body["choices"][0]["text"] == kept.text
    start_id = offline.tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]
    for skip, expected in ((True, ""), (False, "<|im_start|>" * 3)):
        chat = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": 0.0, "ignore_eos": True, "logit_bias": {str(start_id): 100},
            "skip_special_tokens": skip}).json()
        assert chat["choices"][0]["message"]["content"] == expected


def test_completion_logprobs_match_the_engine_and_stream_the_same(
        http: httpx.Client, offline: LLM) -> None:
    ids = offline.tokenizer.encode(PROMPT)
    want = offline.generate([ids], SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3))[0]
    request = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True,
               "logprobs": 3}
    logprobs = http.post("/v1/completions", json=request).json()["choices"][0]["logprobs"]
    decode = offline.tokenizer.decode
    texts = [decode([e.token_id], skip_special_tokens=False) for e in want.logprobs]
    assert logprobs["tokens"] == texts
    assert logprobs["token_logprobs"] == pytest.approx([e.logprob for e in want.logprobs],
                                                       abs=1e-4)
    for top, entry in zip(logprobs["top_logprobs"], want.logprobs, strict=True):
        expected = {decode([i], skip_special_tokens=False): lp for i, lp in entry.top}
        expected.setdefault(decode([entry.token_id], skip_special_tokens=False), entry.logprob)
        assert top.keys() == expected.keys() and len(top) <= 4
        assert list(top.values()) == pytest.approx(list(expected.values()), abs=1e-4)
    offsets = [sum(len(t) for t in texts[:k]) for k in range(len(texts))]
    assert logprobs["text_offset"] == offsets
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for event in _events(http.post("/v1/completions", json={**request, "stream": True})):
        chunk = event["choices"][0]["logprobs"]
        for key in streamed:
            streamed[key] += chunk[key]
    assert streamed == logprobs


def test_chat_logprobs_in_openai_shape_streamed_the_same(http: httpx.Client, client) -> None:
    messages = [{"role": "user", "content": "Tell me about caches"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                         temperature=0.0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 8
    for item in content:
        assert item.bytes == list(item.token.encode()) and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.top_logprobs[0].token == item.token  # greedy: the most likely one
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                            temperature=0.0, logprobs=True, top_logprobs=2,
                                            stream=True, extra_body={"ignore_eos": True})
    streamed = [item for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for item in chunk.choices[0].logprobs.content]
    assert [i.model_dump() for i in streamed] == [i.model_dump() for i in content]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    assert plain.choices[0].logprobs is None
    only = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3,
                                                   "logprobs": True}).json()
    assert all(item["top_logprobs"] == [] for item in only["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize("fields, param", [
    ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 200}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [999999]}, "stop_token_ids"),
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"), ({"frequency_penalty": -2.5},
                                                          "frequency_penalty"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"guided_json": {"type": "strin"}}, "guided_json"), ({"prompt_logprobs": 21},
                                                          "prompt_logprobs"),
])
def test_bad_or_unsupported_completion_fields_are_400(http: httpx.Client, fields: dict,
                                                      param: str) -> None:
    _error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, **fields}), param)


@pytest.mark.parametrize("fields, param", [
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21},
                                            "top_logprobs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"tool_choice": "required"}, "tool_choice"), ({"continue_final_message": True},
                                                   "continue_final_message"),
    ({"chat_template": "{{ 'x' }}"}, "chat_template"),
])
def test_bad_or_unsupported_chat_fields_are_400(http: httpx.Client, fields: dict, param: str
                                                ) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **fields}
    error = _error(http.post("/v1/chat/completions", json=body), param)
    if param in ("continue_final_message", "chat_template"):
        assert error["code"] == "unsupported_parameter" and "store" in error["message"]


def test_openai_bookkeeping_fields_and_nulls_pass(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "user": "u-1",
            "service_tier": "auto", "metadata": {"k": "v"}, "store": False, "n": 1, "seed": 3,
            "parallel_tool_calls": True, "tool_choice": "none", "use_beam_search": None,
            "stream_options": None}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


@pytest.fixture(scope="module")
def qwen3_template_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tiny model with Qwen3's chat template (its special tokens are plain text here)."""
    folder = Path(shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("q3") / "m"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / "qwen3.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    running = start_server(folder)
    yield running, config
    stop_server(running)


def test_chat_template_kwargs_reach_the_template(qwen3_template_server) -> None:
    running, config = qwen3_template_server
    template = ChatTemplate(config["chat_template"], {"eos_token": config["eos_token"]})
    tok = running.engine.tokenizer
    history = [{"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": "4", "reasoning_content": "add them"},
               {"role": "user", "content": "and 3+3?"}]
    with httpx.Client(base_url=running.url, timeout=60) as http:
        for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}, None):
            body = {"messages": history, "max_tokens": 1, "chat_template_kwargs": kwargs}
            usage = http.post("/v1/chat/completions", json=body).json()["usage"]
            text = template.render(history, **(kwargs or {}))
            assert usage["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))
        off = template.render(history, enable_thinking=False)
        assert off.endswith("<think>\n\n</think>\n\n") and "add them" not in off
        last = history[:2]  # the reasoning of an answer after the last user turn is kept
        assert "<think>\nadd them\n</think>" in template.render(last, add_generation_prompt=False)
        # vLLM 0.32's clients send the reasoning back as `reasoning`: the same prompt
        renamed = [history[0], {"role": "assistant", "content": "4", "reasoning": "add them"}]
        tokens = [http.post("/tokenize", json={"messages": m, "add_generation_prompt": False})
                  .json()["count"] for m in (last, renamed)]
        assert tokens[0] == tokens[1]
