"""Shared pytest setup: skip `gpu` tests without CUDA, `cluster` tests without their parts,
`vllm` tests without vLLM; the tiny model every folder's tests load, stores closed and an
in-process CLI's log handlers removed after each test."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _cli_log_handlers_removed() -> Iterator[None]:
    """A test that runs a CLI in its own process space (``main([...])``) installs the CLI's log
    handlers (``kvstore.log_lines.configure``) on that test's captured stderr, which pytest
    closes after it: taken off again, so no later test's threads write to a closed file."""
    yield
    loggers = [logging.getLogger(), *(logger for logger in logging.root.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    for logger in loggers:
        for handler in [h for h in logger.handlers if getattr(h, "_kvstore_lines", False)]:
            logger.removeHandler(handler)


@pytest.fixture
def make_store() -> Iterator[Callable[..., Any]]:
    """TieredStores from StoreConfig fields (``file_ops``: the SSD tier's), closed after the
    test."""
    from kvstore.store.ssd.files import OS_FILE_OPS
    from kvstore.store.tiered import StoreConfig, TieredStore

    stores: list[TieredStore] = []

    def make(file_ops=OS_FILE_OPS, **kwargs) -> TieredStore:
        store = TieredStore(StoreConfig(**kwargs), ssd_file_ops=file_ops)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``kvengine make-model --preset tiny --seed 0`` output (float32), made once per session;
    tests read it and never change it."""
    from engine.make_model import write_checkpoint

    out = tmp_path_factory.mktemp("tiny") / "model"
    write_checkpoint(out, "tiny", seed=0)
    return out


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _has_cluster_parts() -> bool:
    try:
        import ucxx  # noqa: F401
    except Exception:
        return False
    return shutil.which("redis-server") is not None


def _has_vllm() -> bool:
    """vllm is installed (found, not imported: importing it costs seconds and pulls in torch)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_gpu = _has_gpu()
    has_cluster = _has_cluster_parts()
    has_vllm = _has_vllm()
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU with CuPy"))
        if "cluster" in item.keywords and not has_cluster:
            item.add_marker(pytest.mark.skip(reason="needs redis-server and ucxx"))
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="vllm is not installed"))
