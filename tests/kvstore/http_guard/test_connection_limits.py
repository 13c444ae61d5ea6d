"""The arithmetic behind the connection guard: limits fitted to the open-file limit, and the
rate-limited log (the live behaviour is in tests/reliability/test_http_slow_clients.py)."""

from __future__ import annotations

import pytest

from kvstore.http_guard.connection_guard import (
    FDS_KEPT_FOR_THE_PROCESS,
    MAX_ACCEPT_BACKLOG,
    ConnectionLimits,
    fit_to_open_files,
)


@pytest.mark.parametrize("max_open_files", [64, 100, 256, 1024, 4096, 1 << 16])
def test_fitted_limits_leave_room_for_three_accept_bursts(max_open_files: int) -> None:
    fitted = fit_to_open_files(ConnectionLimits(max_connections=1024), max_open_files)
    assert 1 <= fitted.max_connections <= 1024
    assert 1 <= fitted.accept_backlog <= MAX_ACCEPT_BACKLOG
    if max_open_files > 2 * FDS_KEPT_FOR_THE_PROCESS:
        used = fitted.max_connections + 3 * fitted.accept_backlog + FDS_KEPT_FOR_THE_PROCESS
        assert used <= max_open_files


def test_a_generous_limit_changes_nothing() -> None:
    wanted = ConnectionLimits(max_connections=1024, timeout_keep_alive_s=3.0,
                              request_read_timeout_s=9.0)
    assert fit_to_open_files(wanted, 1 << 16) == wanted


@pytest.mark.parametrize("kwargs", [{"max_connections": 0}, {"timeout_keep_alive_s": 0},
                                    {"request_read_timeout_s": -1.0}, {"accept_backlog": 0}])
def test_bad_limits_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ConnectionLimits(**kwargs)
