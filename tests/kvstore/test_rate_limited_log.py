"""The rate-limited log the daemon's socket, its admin port and the engine's HTTP front share: one
line per kind of event per interval, the rest counted; %-style arguments filled in only for the
lines that go out."""

from __future__ import annotations

import logging

from kvstore.rate_limited_log import RateLimitedLog

LOGGER = "kvstore.test.rate_limited"


def test_rate_limited_log_counts_what_it_does_not_print(caplog) -> None:
    now = [100.0]
    log = RateLimitedLog(logging.getLogger(LOGGER), interval_s=10.0,
                         clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(1000):
            log.event("refused", "refused one")
            now[0] += 0.01  # 1000 events over 10 s
        log.event("timed_out", "timed out one")
        now[0] += 0.5
        log.event("refused", "refused one")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "refused one (repeats: one line per 10 s, with a count)"
    assert messages[1] == "timed out one (repeats: one line per 10 s, with a count)"
    assert messages[2].startswith("refused one (and 999 more like it")
    assert len(messages) == 3
    assert log.counts == {"refused": 1001, "timed_out": 1}


def test_arguments_are_filled_in_only_for_lines_that_go_out(caplog) -> None:
    class Loud:
        formatted = 0

        def __str__(self) -> str:
            Loud.formatted += 1
            return "loud"

    log = RateLimitedLog(logging.getLogger(LOGGER), interval_s=3600.0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for cap in (7, 8, 9):
            log.event("refused", "connection refused: %d connections open (%s)", cap, Loud())
    assert [r.getMessage() for r in caplog.records] == [
        "connection refused: 7 connections open (loud) (repeats: one line per 3600 s, with a "
        "count)"]
    assert Loud.formatted == 1


def test_a_message_without_arguments_is_taken_as_it_is_and_carries_its_exception(caplog) -> None:
    log = RateLimitedLog(logging.getLogger(LOGGER), interval_s=0.0)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        try:
            raise ValueError("boom")
        except ValueError:
            log.event("load failed", "100% of a core", level=logging.ERROR, exc_info=True)
        log.event("save failed", "%s of %d", "one", 2, level=logging.ERROR)
    assert [r.getMessage().split(" (repeats")[0] for r in caplog.records] == [
        "100% of a core", "one of 2"]
    assert caplog.records[0].exc_info is not None and caplog.records[0].exc_info[0] is ValueError
    assert not caplog.records[1].exc_info
