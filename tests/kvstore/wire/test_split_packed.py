"""``split_packed`` cuts a packed chain into its items in slices of C calls: every item, in order,
whatever the count around a slice's boundary."""

from __future__ import annotations

import os

import pytest

from kvstore.wire.verbs import _SPLIT_ITEMS, split_packed


@pytest.mark.parametrize("count", [0, 1, _SPLIT_ITEMS - 1, _SPLIT_ITEMS, _SPLIT_ITEMS + 1,
                                   3 * _SPLIT_ITEMS + 7])
def test_every_item_in_order(count: int) -> None:
    data = os.urandom(16 * count)
    items = split_packed(data, 16)
    assert len(items) == count and b"".join(items) == data
    assert all(type(item) is bytes for item in items)
