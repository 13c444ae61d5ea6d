"""Fixtures for the storage-core tests: stores that are closed after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvstore.store.tiered import StoreConfig, TieredStore


@pytest.fixture
def make_store() -> Iterator[Callable[..., TieredStore]]:
    stores: list[TieredStore] = []

    def make(**kwargs) -> TieredStore:
        store = TieredStore(StoreConfig(**kwargs))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()
