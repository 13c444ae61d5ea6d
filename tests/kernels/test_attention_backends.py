"""The attention choice (kernels/attention_backends.py) and what the CPU backend reports."""

from __future__ import annotations

import sys

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


@pytest.mark.gpu
def test_a_gpu_without_the_cudnn_frontend_says_so_at_warning(monkeypatch, caplog) -> None:
    """An H200 run whose image lacked the frontend served every phase with our kernels (agent
    turns' TTFT 1.5-1.7x, inter-token latency 1.2x) and said so only at info: it now warns,
    naming why and how to choose it."""
    pytest.importorskip("cupy")
    monkeypatch.delenv("KVSTORE_ATTENTION", raising=False)
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn fails
    with caplog.at_level("WARNING", logger="kernels.cupy_ops"):
        ops = make_ops("cuda")
    try:
        assert ops.attention_backends == {"prefill": "ours", "decode": "ours"}
        assert ops.attention_backend.startswith("prefill=ours decode=ours (")
        [record] = [r for r in caplog.records if r.name == "kernels.cupy_ops"]
        assert "cuDNN is not available" in record.getMessage()
        assert "KVSTORE_ATTENTION=ours" in record.getMessage()
    finally:
        ops.close()
