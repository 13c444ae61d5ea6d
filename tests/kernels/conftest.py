"""Fixtures of the GPU kernel tests: CuPy and the bf16 dtype, imported only where a test runs."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


@pytest.fixture(scope="module")
def bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16
