"""PromptTokenizer gives exactly the engine tokenizer's ids, cached per special-token segment."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.prompt_tokenizer import PromptTokenizer

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
pieces = st.one_of(st.sampled_from(SPECIALS), st.text(max_size=120),
                   st.sampled_from(["<|im_", "|>", " ", "\n\n", "  x", "caf\u00e9 \U0001f600"]))


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir):
    from engine.tokenizer import Tokenizer

    engine_tokenizer = Tokenizer(tiny_model_dir)
    return engine_tokenizer, PromptTokenizer(engine_tokenizer, tiny_model_dir)


def test_segmenting_is_on_for_the_tiny_tokenizer(tokenizers) -> None:
    assert tokenizers[1].segmented


@settings(max_examples=150, deadline=None)
@given(st.lists(pieces, max_size=12), st.booleans())
def test_same_ids_as_the_tokenizer(tokenizers, parts: list[str], add_special: bool) -> None:
    engine_tokenizer, prompt_tokenizer = tokenizers
    text = "".join(parts)
    expected = engine_tokenizer.encode(text, add_special_tokens=add_special)
    assert prompt_tokenizer.encode(text, add_special_tokens=add_special) == expected
    assert prompt_tokenizer.encode(text, add_special_tokens=add_special) == expected  # cached


def test_earlier_turns_hit_the_cache(tokenizers, tiny_model_dir) -> None:
    engine_tokenizer, _ = tokenizers
    cached = PromptTokenizer(engine_tokenizer, tiny_model_dir)
    messages = [{"role": "user", "content": "a long first question about caches " * 20}]
    first = engine_tokenizer.apply_chat_template(messages)
    assert cached.encode(first, False) == engine_tokenizer.encode(first, False)
    assert (cached.num_hits, cached.num_misses) == (0, 1)
    messages += [{"role": "assistant", "content": "an answer " * 30},
                 {"role": "user", "content": "and a follow-up question " * 10}]
    second = engine_tokenizer.apply_chat_template(messages)
    assert cached.encode(second, False) == engine_tokenizer.encode(second, False)
    # The first turn is a segment seen before; only the two new turns went to the tokenizer.
    assert (cached.num_hits, cached.num_misses) == (1, 3)


def test_without_segmenting_whole_prompts_are_cached(tokenizers) -> None:
    engine_tokenizer, _ = tokenizers
    whole = PromptTokenizer(engine_tokenizer, None)
    assert not whole.segmented
    text = "<|im_start|>user\n" + "some words " * 40 + "<|im_end|>"
    for _ in range(2):
        assert whole.encode(text) == engine_tokenizer.encode(text)
    assert (whole.num_hits, whole.num_misses) == (1, 1)


def test_cache_is_bounded(tokenizers, tiny_model_dir) -> None:
    engine_tokenizer, _ = tokenizers
    small = PromptTokenizer(engine_tokenizer, tiny_model_dir, max_cached_tokens=200)
    for i in range(20):
        text = f"prompt number {i} " + "filler words here " * 10
        assert small.encode(text) == engine_tokenizer.encode(text)
    assert small._num_cached_tokens <= 200
