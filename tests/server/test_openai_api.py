"""A stock `openai` client against a real server: completions, chat, streaming, n, stop, seed."""

from __future__ import annotations

import pytest

PROMPT = "The tiered cache keeps blocks of keys and values"


def _greedy(client, prompt=PROMPT, max_tokens=12, **extra):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0.0, extra_body={"ignore_eos": True, **extra})


def test_models_lists_the_served_name(client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion_counts_tokens(client, server) -> None:
    out = _greedy(client, max_tokens=7)
    assert out.object == "text_completion"
    assert out.model == "tiny"
    [choice] = out.choices
    assert choice.finish_reason == "length"
    assert isinstance(choice.text, str)
    usage = out.usage
    assert usage.completion_tokens == 7
    assert usage.prompt_tokens == len(server.engine.tokenizer.encode(PROMPT))
    assert usage.total_tokens == usage.prompt_tokens + 7
    details = usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    by_tier = details.model_extra["cached_tokens_by_tier"]
    assert set(by_tier) == {"hbm", "hbm_peer", "dram", "ssd", "remote"}


def test_token_id_prompt_matches_text_prompt(client, server) -> None:
    ids = server.engine.tokenizer.encode(PROMPT)
    by_text = _greedy(client)
    by_ids = _greedy(client, prompt=ids)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_batch_of_prompts_gives_one_choice_each(client) -> None:
    out = client.completions.create(model="tiny", prompt=[PROMPT, "another prompt"],
                                    max_tokens=3, temperature=0.0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == _greedy(client, max_tokens=3).choices[0].text
    assert out.usage.completion_tokens == 6


def test_streaming_completion_equals_non_streaming(client) -> None:
    expected = _greedy(client).choices[0].text
    chunks = list(client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_and_chat_streaming_agree(client) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say something about caches."}]
    out = client.chat.completions.create(model="tiny", messages=messages, temperature=0.0,
                                         max_completion_tokens=9, extra_body={"ignore_eos": True})
    assert out.object == "chat.completion"
    [choice] = out.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 9
    stream = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0.0, max_tokens=9, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


def test_n_samples_are_distinct_and_seeded(client) -> None:
    def sample(n: int, seed: int):
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=n,
                                        temperature=1.0, seed=seed,
                                        extra_body={"ignore_eos": True})
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)], out.usage

    texts, usage = sample(3, seed=11)
    assert len(texts) == 3
    assert len(set(texts)) > 1, "n samples with temperature 1 should not all agree"
    assert usage.completion_tokens == 24
    assert sample(3, seed=11)[0] == texts  # the same seed gives the same samples
    assert sample(1, seed=11)[0] == texts[:1]  # sample 0 uses the seed itself
    assert sample(3, seed=12)[0] != texts


def test_seed_makes_sampling_reproducible(client) -> None:
    def once(seed):
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10,
                                         temperature=1.0, top_p=0.9, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    first = once(1234)
    assert once(1234) == first
    assert any(once(s) != first for s in (1, 2, 3))


def test_top_k_one_is_greedy(client) -> None:
    greedy = _greedy(client).choices[0].text
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0,
                                    seed=5, extra_body={"top_k": 1, "ignore_eos": True})
    assert out.choices[0].text == greedy


@pytest.mark.parametrize("as_list", [False, True])
def test_stop_string_trims_and_finishes(client, as_list: bool) -> None:
    full = _greedy(client, max_tokens=24).choices[0].text
    # A stop string whose first occurrence is past the start, so the answer is non-empty.
    cut, stop = next((k, full[k:k + 2]) for k in range(1, len(full) - 2)
                     if full[k:k + 2].strip() and full.find(full[k:k + 2]) == k)
    stops = ["\u2603never", stop] if as_list else stop
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.0,
                                    stop=stops, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[:cut]
