"""The multi-turn workload generator, the run summary and the sweep's sizing and targets."""

from __future__ import annotations

import random

import pytest

from benchmarks.multiturn.request_record import RequestRecord
from benchmarks.multiturn.summary import summarize
from benchmarks.multiturn.sweep_report import evaluate_targets
from benchmarks.sizing import plan_sizing
from benchmarks.workload import (
    WORDS,
    Conversation,
    WorkloadConfig,
    make_conversations,
    words_text,
)


def _config(**kwargs) -> WorkloadConfig:
    fields = dict(num_users=3, num_rounds=4, system_prompt_len=100, history_len=200,
                  answer_len=16, question_len=12, seed=7)
    fields.update(kwargs)
    return WorkloadConfig(**fields)


def _play(conv: Conversation) -> list[list[dict]]:
    prompts = []
    while not conv.done:
        prompts.append(conv.next_messages())
        conv.add_answer(f"answer {conv.user}.{conv.round}")
    return prompts


def test_same_seed_same_conversations_other_seed_other_text() -> None:
    a = [_play(c) for c in make_conversations(_config())]
    b = [_play(c) for c in make_conversations(_config())]
    c = [_play(c) for c in make_conversations(_config(seed=8))]
    assert a == b
    assert a != c


def test_users_share_the_system_prompt_and_nothing_else() -> None:
    convs = make_conversations(_config())
    first = [c.next_messages() for c in convs]
    assert len({m[0]["content"] for m in first}) == 1 and first[0][0]["role"] == "system"
    assert len({m[1]["content"] for m in first}) == len(convs)


def test_a_user_does_not_depend_on_the_order_users_run_in() -> None:
    forward = make_conversations(_config())
    backward = make_conversations(_config())
    got_forward = [_play(c) for c in forward]
    got_backward = [_play(c) for c in reversed(backward)][::-1]
    assert got_forward == got_backward


def test_history_grows_by_the_question_and_the_answer() -> None:
    conv = make_conversations(_config())[0]
    prev = conv.next_messages()
    assert conv.next_messages() == prev  # asking again does not draw a new question
    for _ in range(3):
        conv.add_answer("the answer")
        cur = conv.next_messages()
        assert cur[:len(prev)] == prev  # the previous prompt is a prefix: the cache can hit
        assert cur[len(prev)] == {"role": "assistant", "content": "the answer"}
        assert cur[-1]["role"] == "user" and cur[-1]["content"].endswith("?")
        prev = cur
    conv.add_answer(None)  # a failed request: a stand-in answer keeps the history growing
    assert conv.done and conv.messages[-1]["content"]
    roles = [m["role"] for m in conv.messages[1:]]
    assert roles == ["user", "assistant"] * 4
    with pytest.raises(RuntimeError):
        conv.next_messages()


def test_agentic_turns_carry_a_long_tool_result() -> None:
    plain = make_conversations(_config())[1]
    agent = make_conversations(_config(agentic=True, tool_result_len=520,
                                       tokens_per_word=1.3))[1]
    _play(plain)
    prompts = _play(agent)
    for rnd, prompt in enumerate(prompts):
        turn = prompt[-1]["content"]
        assert f"Tool output (call {rnd + 1})" in turn
        tool_words = turn.split("\n\n")[-2].split("\n", 1)[1].split()
        assert len(tool_words) == pytest.approx(400, abs=1)
    assert sum(len(m["content"]) for m in agent.messages) > 3 * sum(
        len(m["content"]) for m in plain.messages)
    assert agent.config.turn_len() > plain.config.turn_len() + 500


def test_words_text_hits_its_word_count() -> None:
    rng = random.Random(0)
    text = words_text(rng, 650, tokens_per_word=1.3)
    words = text.split()
    assert len(words) == 500
    assert all(w.strip(".").lower() in WORDS for w in words)
    assert words_text(rng, 0, 1.3) == ""


def test_bad_configs_are_refused() -> None:
    for bad in (dict(num_users=0), dict(num_rounds=0), dict(answer_len=0),
                dict(history_len=-1), dict(tokens_per_word=0.0)):
        with pytest.raises(ValueError):
            _config(**bad)


def test_summary_counts_hits_by_tier_per_round() -> None:
    def rec(user, rnd, ttft, prompt, by_tier, error=None):
        return RequestRecord(user=user, round=rnd, scheduled_s=0.0, sent_s=0.0,
                             prompt_tokens=prompt, completion_tokens=4,
                             cached_tokens=sum(by_tier.values()), cached_tokens_by_tier=by_tier,
                             ttft_s=ttft, itl_s=[0.01, 0.03], e2e_s=ttft + 0.04, error=error)

    records = [rec(0, 0, 0.2, 100, {"hbm": 0, "dram": 0}),
               rec(1, 0, 0.4, 100, {"hbm": 32, "dram": 0}),
               rec(0, 1, 0.1, 200, {"hbm": 32, "dram": 128}),
               rec(1, 1, 9.9, 200, {"hbm": 0, "dram": 0}, error="timeout after 1 s")]
    s = summarize(records, wall_s=2.0)
    assert (s["num_requests"], s["num_ok"], s["num_errors"]) == (4, 3, 1)
    assert s["ttft_ms"]["mean"] == pytest.approx(700 / 3)
    assert s["ttft_ms"]["p50"] == pytest.approx(200)
    assert s["itl_ms"]["p50"] == pytest.approx(20)
    assert s["throughput"]["requests_per_s"] == pytest.approx(1.5)
    r0, r1 = s["rounds"]
    assert r0["hit_rate_by_tier"]["hbm"] == pytest.approx(32 / 200)
    assert r1["num_ok"] == 1 and r1["hit_rate"] == pytest.approx(160 / 200)
    assert r1["hit_rate_by_tier"]["dram"] == pytest.approx(128 / 200)
    assert s["errors"] == ["timeout after 1 s"]


def test_sizing_puts_the_working_set_in_and_out_of_hbm() -> None:
    workload = _config(num_users=16, history_len=400)
    sizing = plan_sizing(workload, block_bytes=8192, max_positions=4096, block_size=16,
                         pressure_factor=4.0)
    ws_blocks = sizing["working_set_blocks_est"]
    fits, pressure = sizing["regimes"]["fits"], sizing["regimes"]["pressure"]
    assert fits["num_kv_blocks"] >= ws_blocks
    assert pressure["working_set_over_hbm"] == pytest.approx(4.0, rel=0.05)
    assert isinstance(pressure["num_kv_blocks"], int) and isinstance(fits["num_kv_blocks"], int)
    assert pressure["num_kv_blocks"] * 16 >= sizing["max_model_len"]  # the longest prompt fits
    assert sizing["max_model_len"] >= workload.last_prompt_len() + workload.answer_len
    assert sizing["dram_bytes"] >= ws_blocks * 8192
    assert not sizing["notes"]


def test_targets_need_every_qps() -> None:
    def point(regime, offload, qps, mean, error=None):
        return {"regime": regime, "offload": offload, "qps": qps, "error": error,
                "summary": {"ttft_ms": {"mean": mean}}}

    points = [point("pressure", True, 1, 10.0), point("pressure", False, 1, 40.0),
              point("pressure", True, 2, 20.0), point("pressure", False, 2, 50.0),
              point("fits", True, 1, 10.2), point("fits", False, 1, 10.0)]
    targets = evaluate_targets(points, [1, 2])
    assert [r["speedup"] for r in targets["pressure"]["per_qps"]] == [4.0, 2.5]
    assert targets["pressure"]["met"] is False
    assert targets["fits"]["per_qps"][0]["overhead"] == pytest.approx(0.02)
    assert targets["fits"]["met"] is None  # qps 2 of the fits regime is missing
    points[3] = point("pressure", False, 2, 60.0)
    assert evaluate_targets(points, [1, 2])["pressure"]["met"] is True
