"""The attention choice (kernels/attention_backends.py) and what the CPU backend reports."""

from __future__ import annotations

import pytest

from kernels import make_ops
from kernels.attention_backends import wanted_backends


def test_auto_is_cudnn_for_both(monkeypatch) -> None:
    monkeypatch.delenv("KVSTORE_ATTENTION", raising=False)
    assert wanted_backends() == {"prefill": "cudnn", "decode": "cudnn"}
    assert wanted_backends(" Ours ") == {"prefill": "ours", "decode": "ours"}
    monkeypatch.setenv("KVSTORE_ATTENTION", "ours")
    assert wanted_backends() == {"prefill": "ours", "decode": "ours"}


def test_an_unknown_choice_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_ATTENTION", "flash")
    with pytest.raises(ValueError, match="KVSTORE_ATTENTION"):
        wanted_backends()


def test_the_cpu_backend_reports_the_references() -> None:
    ops = make_ops("cpu")
    assert ops.attention_backend == "prefill=reference decode=reference"
