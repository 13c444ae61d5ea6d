"""The daemon's rate-limited log: %-style arguments filled in for the lines that go out, the
rest only counted."""

from __future__ import annotations

import logging

from kvstore.daemon.accept import RateLimitedLog

LOGGER = "kvstore.test.rate_limited"


def test_arguments_are_filled_in_and_repeats_within_the_interval_are_counted(caplog) -> None:
    log = RateLimitedLog(logging.getLogger(LOGGER), interval_s=3600.0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for cap in (7, 8, 9):
            log.warning("connection refused: %d connections open", cap)
    assert [r.getMessage() for r in caplog.records] == [
        "connection refused: 7 connections open (logged at most every 3600 s, with a count)"]


def test_a_message_without_arguments_is_taken_as_it_is(caplog) -> None:
    log = RateLimitedLog(logging.getLogger(LOGGER), interval_s=0.0)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        log.log(logging.ERROR, "100% of a core")
        log.log(logging.ERROR, "%s of %d", "one", 2)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["100% of a core",
                                                                      "one of 2"]
