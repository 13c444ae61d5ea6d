"""A constraint after the reasoning (``structured_outputs.reasoning_end``): the output is free
until the model generates the end-of-reasoning token, and constrained from the token after it.

The thinking variant of the tiny model (tests/support/thinking_model.py) has ``<think>`` and
``</think>`` as tokens of their own. Its weights are random, so it never writes ``</think>`` by
chance: a ``logit_bias`` on that token makes it come after a few free tokens, seeded. The bias
stays on after it, where the grammar's mask must win over it.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from support.thinking_model import END, write_thinking_model

from engine import LLM, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.grammar import GrammarPhase
from engine.grammar_masks import GrammarMasks
from engine.sequence import Sequence
from engine.structured_outputs import StructuredOutputsParams
from kernels import make_ops

TRIP = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Zürich", "Tokyo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
AFTER_THINKING = {"json": TRIP, "reasoning_end": END}
PROMPTS = ["Plan the trip.", "Where to?", "x", "The weather in Paris"]


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory,
             tiny_model_dir: Path) -> tuple[LLM, int, int]:
    """The thinking model on the CPU, with the ids of ``<think>`` and ``</think>``."""
    out = tmp_path_factory.mktemp("thinking") / "model"
    start_id, end_id = write_thinking_model(tiny_model_dir, out)
    return LLM(str(out), device="cpu"), start_id, end_id


def _open_prompts(llm: LLM, start_id: int) -> list[list[int]]:
    """Prompts whose thinking block is open (their last token is ``<think>``)."""
    return [llm.tokenizer.encode(p) + [start_id] for p in PROMPTS]


def _grammar_takes(llm: LLM, token_ids: list[int]) -> bool:
    """Whether TRIP's grammar, from its start, takes these tokens."""
    matcher = llm.engine.grammars.matcher(StructuredOutputsParams(json=TRIP))
    return all(matcher.accept(t) for t in token_ids)


def _answer(text: str) -> str:
    """The JSON after at most two newlines (the separator the grammar allows), checked."""
    body = text.lstrip("\n")
    assert len(text) - len(body) <= 2, repr(text)
    value = json.loads(body)
    jsonschema.validate(value, TRIP)
    assert json.dumps(value, ensure_ascii=False) == body  # json.dumps' layout, nothing more
    return body


def test_the_output_is_free_until_the_end_token_then_constrained(thinking) -> None:
    llm, start_id, end_id = thinking
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=200, logit_bias={end_id: 6.0},
                            structured_outputs=AFTER_THINKING)
    num_free = []
    for out in llm.generate(_open_prompts(llm, start_id), params):
        assert out.finish_reason == "stop", out.text  # the grammar ended it, not max_tokens
        assert out.token_ids.count(end_id) == 1, out.text  # after it the mask beat the bias
        cut = out.token_ids.index(end_id)
        num_free.append(cut)
        if cut:  # unmasked before: the grammar would have refused what came out
            assert not _grammar_takes(llm, out.token_ids[:cut])
        reasoning, answer = out.text.split(END)
        _answer(answer)
    assert sum(n > 0 for n in num_free) >= 3, num_free  # most thought first


def test_the_mask_is_off_before_the_end_token_and_on_after(thinking) -> None:
    """GrammarMasks over a step's logits: a reasoning row is left alone, the same row after
    ``</think>`` gets the grammar's mask (only the separator and ``{`` may start the answer)."""
    llm, start_id, end_id = thinking
    params = SamplingParams(structured_outputs=AFTER_THINKING)
    prompt = _open_prompts(llm, start_id)[0]
    grammar = llm.engine.grammars.matcher(params.structured_outputs, prompt)
    seq = Sequence(request_id="r", prompt_token_ids=prompt, params=params,
                   namespace_digest=b"", generator=np.random.default_rng(0),
                   detokenizer=IncrementalDetokenizer(llm.tokenizer, None), grammar=grammar)
    masks = GrammarMasks(make_ops("cpu"))
    vocab_size = llm.engine.model_config.vocab_size
    thought = llm.tokenizer.encode(" so the answer is")
    for token_id in thought:
        assert grammar.phase is GrammarPhase.REASONING
        logits = masks.apply(np.zeros((1, vocab_size), dtype=np.float32), [seq])
        assert np.isfinite(logits).all()  # no mask while thinking
        assert not grammar.advance(token_id)
    assert not grammar.advance(end_id)
    assert grammar.phase is GrammarPhase.CONSTRAINED and grammar.is_active
    logits = masks.apply(np.zeros((1, vocab_size), dtype=np.float32), [seq])
    allowed = np.flatnonzero(np.isfinite(logits[0]))
    texts = {llm.tokenizer.decode([int(t)], skip_special_tokens=False) for t in allowed}
    assert "{" in texts and "\n" in texts
    assert all(t.strip("\n") in ("", "{") or t.lstrip("\n").startswith("{") for t in texts)
    assert end_id not in allowed and start_id not in allowed


def test_a_prompt_that_ends_the_reasoning_constrains_from_the_first_token(thinking) -> None:
    """Qwen3's template with enable_thinking false writes ``<think>\\n\\n</think>\\n\\n``: the
    grammar starts at once, without the separator; a ``</think>`` further back does not count."""
    llm, start_id, end_id = thinking
    closed = [llm.tokenizer.encode(p + "<think>\n\n</think>\n\n") for p in PROMPTS]
    assert all(ids[-3:] == [end_id, *llm.tokenizer.encode("\n\n")] for ids in closed)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=200, logit_bias={end_id: 6.0},
                            structured_outputs=AFTER_THINKING)
    for out in llm.generate(closed, params):
        assert out.finish_reason == "stop" and end_id not in out.token_ids
        assert _answer(out.text) == out.text  # "{" first
    compiler, spec = llm.engine.grammars, StructuredOutputsParams(**AFTER_THINKING)
    earlier_turn = llm.tokenizer.encode("<think>\nhm\n</think>\n\nok<|im_end|>\n<|im_start|>"
                                        "assistant\n")
    assert not compiler.matcher(spec, earlier_turn).is_active
    assert not compiler.matcher(spec, llm.tokenizer.encode("no thinking here")).is_active
    assert compiler.matcher(spec, closed[0]).is_active


def test_reasoning_that_runs_out_of_tokens_ends_with_length(thinking) -> None:
    llm, start_id, end_id = thinking
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                            structured_outputs=AFTER_THINKING)
    for out in llm.generate(_open_prompts(llm, start_id), params):
        assert out.finish_reason == "length" and len(out.token_ids) == 12
        assert end_id not in out.token_ids


def test_without_reasoning_end_the_grammar_applies_from_the_first_token(thinking) -> None:
    """The same open prompts and bias, the constraint alone: as before this change."""
    llm, start_id, end_id = thinking
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=200, logit_bias={end_id: 6.0},
                            structured_outputs={"json": TRIP})
    for out in llm.generate(_open_prompts(llm, start_id), params):
        assert out.finish_reason == "stop" and end_id not in out.token_ids
        assert _answer(out.text) == out.text


@pytest.mark.parametrize("marker", ["</nope>", "end of thought"])
def test_reasoning_end_must_be_one_token(thinking, marker: str) -> None:
    llm, _, _ = thinking
    params = SamplingParams(structured_outputs={"json": TRIP, "reasoning_end": marker})
    with pytest.raises(ValueError, match="structured_outputs.reasoning_end: .* is not one token"):
        llm.engine.add_request("bad", [1, 2, 3], params)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="reasoning_end must be a non-empty string"):
        SamplingParams(structured_outputs={"json": TRIP, "reasoning_end": ""})
