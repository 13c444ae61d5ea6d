"""The environment's debug switches (``kvstore/settings.py``): off unless set, a malformed value
refused with the variable's name."""

from __future__ import annotations

import pytest

from kvstore.settings import load_env_settings


def test_stall_stacks_are_off_unless_asked_for() -> None:
    assert load_env_settings({}).debug_stall_stacks is False
    assert load_env_settings({"KVSTORE_DEBUG_STALL_STACKS": "0"}).debug_stall_stacks is False
    assert load_env_settings({"KVSTORE_DEBUG_STALL_STACKS": "1"}).debug_stall_stacks is True
    with pytest.raises(ValueError, match="KVSTORE_DEBUG_STALL_STACKS must be 0 or 1"):
        load_env_settings({"KVSTORE_DEBUG_STALL_STACKS": "yes"})
