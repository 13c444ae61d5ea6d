"""Sampling through the engine: seeds, top-k/top-p edge cases, stop strings, eos, length limits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from engine_helpers import random_prompts

from engine import LLM, SamplingParams
from engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TOKEN_ID_ITEMS


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path):
    with LLM(str(tiny_model_dir), device="cpu") as llm:
        yield llm


def sample(temperature: float = 1.0, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, **kw)


def test_seeded_requests_are_deterministic_whatever_the_batch(llm: LLM) -> None:
    p, q = random_prompts(4000, [9, 30], seed=1)
    alone = llm.generate([p], sample(seed=5))[0]
    alone_q = llm.generate([q], sample(seed=9, top_k=50, top_p=0.9))[0]
    batch = llm.generate([q, p, q, p], [sample(seed=9, top_k=50, top_p=0.9), sample(seed=5),
                                        sample(), SamplingParams(max_tokens=12)])
    assert batch[0].token_ids == alone_q.token_ids
    assert batch[1].token_ids == alone.token_ids
    assert llm.generate([p], sample(seed=6))[0].token_ids != alone.token_ids
    unseeded = llm.generate([p, p], sample())
    assert unseeded[0].token_ids != unseeded[1].token_ids  # near-flat logits over ~4.7k ids


def test_top_k_one_and_tiny_top_p_equal_greedy(llm: LLM) -> None:
    prompts = random_prompts(4000, [5, 21], seed=2)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    top_k = llm.generate(prompts, sample(temperature=1.5, top_k=1, seed=3))
    top_p = llm.generate(prompts, sample(temperature=0.7, top_p=1e-6))
    for g, k, p in zip(greedy, top_k, top_p):
        assert g.token_ids == k.token_ids == p.token_ids


def test_a_top_k_past_the_vocabulary_keeps_every_token(llm: LLM) -> None:
    """2**31 and more (an int32 overflow in the step, which failed every request of the
    engine) sample as top_k off, as vLLM's do."""
    prompts = random_prompts(4000, [5, 21], seed=4)
    off = llm.generate(prompts, sample(seed=8))
    for huge in (2**31, 10**30):
        assert [o.token_ids for o in llm.generate(prompts, sample(seed=8, top_k=huge))] == \
            [o.token_ids for o in off]
    assert llm.generate(prompts, sample(seed=8))[0].token_ids == off[0].token_ids


def test_stop_string_trims_the_text(llm: LLM) -> None:
    prompt = random_prompts(4000, [7], seed=4)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    text = full.text
    assert len(text) > 20
    stop = text[12:15]
    cut = text.find(stop)
    out = llm.generate([prompt], SamplingParams(max_tokens=30, stop=[stop, "\x00never"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert full.token_ids[: len(out.token_ids)] == out.token_ids
    assert len(out.token_ids) < len(full.token_ids)


def test_a_long_stop_string_beside_short_ones_still_stops_at_the_first(llm: LLM) -> None:
    """Each stop string is searched only where it could end in the new text: one of the
    budget's size (never found) changes nothing for a short one that is."""
    prompt = random_prompts(4000, [7], seed=4)[0]
    text = llm.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0].text
    stop = text[14:16]
    long = "\x00" * (MAX_STOP_CHARS - 1000)
    stops = [long, *(f"\x01{i}" for i in range(MAX_STOP_STRINGS - 2)), stop]
    out = llm.generate([prompt], SamplingParams(max_tokens=30, stop=stops))[0]
    assert out.finish_reason == "stop" and out.text == text[:text.find(stop)]


def test_stop_strings_and_token_id_lists_have_a_budget() -> None:
    SamplingParams(stop=["a"] * MAX_STOP_STRINGS)
    SamplingParams(stop=["b" * MAX_STOP_CHARS])
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS} stop strings"):
        SamplingParams(stop=["a"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_CHARS} characters"):
        SamplingParams(stop=["b" * MAX_STOP_CHARS, "c"])
    SamplingParams(logit_bias=dict.fromkeys(range(MAX_TOKEN_ID_ITEMS), 1.0),
                   stop_token_ids=list(range(MAX_TOKEN_ID_ITEMS)))
    with pytest.raises(ValueError, match="logit_bias entries"):
        SamplingParams(logit_bias=dict.fromkeys(range(MAX_TOKEN_ID_ITEMS + 1), 1.0))
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[1] * (MAX_TOKEN_ID_ITEMS + 1))


def test_eos_stops_unless_ignored(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny_model_dir, tmp_path / "m")
    prompt = random_prompts(4000, [6], seed=5)[0]
    with LLM(str(folder), device="cpu") as llm:
        first = llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    eos = first.token_ids[1]  # make the second greedy token an eos token
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    with LLM(str(folder), device="cpu") as llm:
        assert eos in llm.tokenizer.eos_token_ids
        stopped = llm.generate([prompt], SamplingParams(max_tokens=3))[0]
        ignored = llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert stopped.token_ids == first.token_ids[:2] and stopped.finish_reason == "stop"
    assert stopped.text == llm.tokenizer.decode(first.token_ids[:1])  # eos text is not shown
    assert ignored.token_ids == first.token_ids and ignored.finish_reason == "length"


def test_max_tokens_and_model_length_limits(tiny_model_dir: Path) -> None:
    prompt = random_prompts(4000, [18], seed=6)[0]
    with LLM(str(tiny_model_dir), device="cpu", max_model_len=20) as llm:
        one = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
        unbounded = llm.generate([prompt], SamplingParams(max_tokens=None, ignore_eos=True))[0]
        at_limit = llm.generate([prompt + [5, 6]], SamplingParams(max_tokens=None,
                                                                  ignore_eos=True))[0]
    assert len(one.token_ids) == 1 and one.finish_reason == "length"
    assert len(unbounded.token_ids) == 2 and unbounded.finish_reason == "length"
    assert len(at_limit.token_ids) == 1 and at_limit.finish_reason == "length"


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": "1"},
    {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"top_k": 1.5}, {"max_tokens": 0},
    {"max_tokens": 2.0}, {"seed": -3}, {"seed": True}, {"stop": ""}, {"stop": [1]},
    {"stop": {"a": 1}}, {"ignore_eos": 1},
])
def test_bad_sampling_params_are_value_errors(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_normalize_stop() -> None:
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=[]).stop is None
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy


def test_the_sampler_warm_up_changes_nothing_a_request_sees(tiny_model_dir: Path) -> None:
    """The warm-up samples throwaway rows of every kind (kernels compiled before ready); a
    seeded request with every adjustment then gets the tokens it gets without the warm-up,
    and the processor keeps no row of the throwaway sequences."""
    params = sample(seed=11, top_k=40, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
                    presence_penalty=0.2, frequency_penalty=0.2, logit_bias={7: 3.0},
                    min_tokens=3, logprobs=2)
    prompt = random_prompts(4000, [17], seed=4)[0]
    tokens = []
    for warm in (False, True):
        with LLM(str(tiny_model_dir), device="cpu") as fresh:
            if warm:
                fresh.engine.warm_up()
                assert len(fresh.engine.runner.sampler.processor._rows) == 0
            tokens.append(fresh.generate([prompt], params)[0].token_ids)
    assert tokens[0] == tokens[1]
