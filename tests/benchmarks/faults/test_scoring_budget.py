"""The soak's scoring has a time budget (``--score-budget-s``): past it, a differing answer is
not scored but marked so, and the verdict counts it as unexplained; never a silent pass."""

from __future__ import annotations

import time

from benchmarks.faults.answer_scoring import score_differences, self_variance
from benchmarks.faults.chat_load import ChatRecord
from benchmarks.faults.verdict import verdict


def _record(index: int, answer: str, reference: str) -> ChatRecord:
    return ChatRecord(index=index, user=0, conversation="c", round=0, engine=1, sent_s=0.0,
                      e2e_s=0.1, answer=answer, answer_token_ids=[1, 2], reference=reference)


def test_answers_left_when_the_budget_is_spent_are_marked_and_fail() -> None:
    records = [_record(0, "same", "same"), _record(1, "other", "reference")]
    # no server at this address: past the deadline nothing is even asked
    score_differences(records, "http://127.0.0.1:9", "m", 20, 0.25, 2, 1.0,
                      deadline=time.monotonic() - 1)
    assert records[0].numerics is None  # equal answers need no score
    assert records[1].numerics == {"error": "not scored: the scoring time ran out",
                                   "within": False}
    v = verdict([r.to_json() for r in records], [], [], {"processes": {}}, {"processes": {}},
                0.05, 0)
    assert v["answers"]["unexplained"] == [1] and not v["checks"]["differences_only_numerics"]


def test_the_calibration_counts_what_it_could_not_score() -> None:
    again = {"asked": 3, "errors": 0, "differing": [(_record(0, "a", "b"), [1, 2])]}
    calibration = self_variance(again, "http://127.0.0.1:9", "m", 20, 2, 1.0,
                                deadline=time.monotonic() - 1)
    assert calibration["unscored"] == 1 and calibration["differences"] == 1
    assert calibration["largest_share"] == 0.0 and calibration["errors"] == 0
