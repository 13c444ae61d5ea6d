"""The poisoned-context state: sticky CUDA errors poison once, others pass; health reports it.

The errors here carry CUDA's status codes as CuPy's do (``status``); on a GPU the real path is
forced in ``test_pool_chunks_gpu.py`` (an illegal address read by the copy kernel).
"""

from __future__ import annotations

import pytest

from kvstore.daemon.health import DaemonHealth
from kvstore.daemon.service import Service
from kvstore.engines.cuda_fault import (
    EXIT_CUDA_POISONED,
    ContextPoisoned,
    CudaFault,
    is_sticky,
)
from kvstore.store.config import StoreConfig
from kvstore.store.tiered import TieredStore


class CudaStatusError(RuntimeError):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status


ILLEGAL = CudaStatusError(700, "cudaErrorIllegalAddress: an illegal memory access")
INVALID = CudaStatusError(1, "cudaErrorInvalidValue: invalid argument")


def test_sticky_errors_are_told_apart():
    assert is_sticky(ILLEGAL) and is_sticky(CudaStatusError(719, "launch failure"))
    assert not is_sticky(INVALID) and not is_sticky(ValueError("x"))
    assert is_sticky(RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access"))
    assert EXIT_CUDA_POISONED not in (0, 1, 2)


def test_the_first_sticky_error_poisons_once_and_tells_every_listener_once():
    told: list[str] = []
    fault = CudaFault([told.append])
    fault.observe(INVALID, "a save")
    fault.check()
    assert not fault.poisoned and told == []
    fault.observe(ILLEGAL, "a copy's event")
    fault.observe(CudaStatusError(719, "launch failure"), "another")
    assert fault.poisoned and len(told) == 1 and "illegal" in told[0]
    with pytest.raises(ContextPoisoned, match="poisoned"):
        fault.check()
    late: list[str] = []
    fault.add_listener(late.append)
    assert late == told


def test_health_fails_closed_on_a_poisoned_context(tmp_path):
    store = TieredStore(StoreConfig(dram_bytes=1 << 20, ssd_dir=tmp_path, ssd_bytes=0,
                                    pin_memory=False))
    service = Service(store)
    try:
        health = DaemonHealth(service)
        assert health.report()["cuda"] == {"state": "ok", "reason": ""}
        assert service.health()["status"] == "ok"
        service.registry.cuda_fault.observe(ILLEGAL, "a copy's event")
        report = health.report()
        assert report["status"] == "failing" and report["cuda"]["state"] == "poisoned"
        assert any(p.startswith("cuda: poisoned") for p in report["problems"])
        assert service.health()["status"] == "failing"
        assert "illegal" in service.health()["reason"]
    finally:
        service.close()
        store.close()
