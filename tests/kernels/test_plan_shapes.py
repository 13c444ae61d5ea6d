"""The shapes a cuDNN scope used, remembered for the next start: keys round-trip exactly, the
list is bounded, a damaged file is ignored, a failed write is counted, never raised."""

from __future__ import annotations

import os
from pathlib import Path

from kernels.plan_cache import PlanCache
from kernels.plan_shapes import PlanShapes, key_from_json

KEYS = [(True, True, 1, 1024, 512, 32, 8, 128, 16, (2174, 589824), 0.08838834764831845),
        ("exact", 4096, 4096, 32, 8, 128, 0.125),
        (False, False, 4, 1, 256, 32, 8, 128, 16, (100, 65536), 0.08838834764831845)]


def test_keys_come_back_as_the_same_keys_and_names(tmp_path: Path) -> None:
    shapes = PlanShapes(tmp_path, "scope")
    assert shapes.load() == []
    for key in KEYS:
        assert shapes.add(key)
    assert not shapes.add(KEYS[0])  # known: no write
    again = PlanShapes(tmp_path, "scope").load()
    assert again == KEYS
    # the cache's entry names are digests of the key's repr: they must match exactly
    assert [PlanCache.name(k, "setup") for k in again] == [PlanCache.name(k, "setup")
                                                          for k in KEYS]
    assert PlanShapes(tmp_path, "other scope").load() == []
    assert shapes.path.name.startswith(".")  # not an entry the cache would trim


def test_the_oldest_shapes_go_past_the_bound(tmp_path: Path) -> None:
    shapes = PlanShapes(tmp_path, "scope", max_shapes=2)
    for key in KEYS:
        shapes.add(key)
    assert PlanShapes(tmp_path, "scope").load() == KEYS[1:]


def test_a_damaged_file_is_ignored_and_rewritten(tmp_path: Path) -> None:
    shapes = PlanShapes(tmp_path, "scope")
    for text in ("{not json", '{"a": 1}', '[[1, {"x": 2}]]', "[3]", "[" * 100000):
        shapes.path.write_text(text)
        assert PlanShapes(tmp_path, "scope").load() == []
    fresh = PlanShapes(tmp_path, "scope")
    fresh.load()
    assert fresh.add(KEYS[0]) and PlanShapes(tmp_path, "scope").load() == [KEYS[0]]
    assert key_from_json([[1, 2], "a", 0.5, False]) == ((1, 2), "a", 0.5, False)
    assert key_from_json([None]) is None


def test_a_write_that_fails_is_counted(tmp_path: Path) -> None:
    folder = tmp_path / "gone"
    folder.mkdir()
    shapes = PlanShapes(folder, "scope")
    os.rmdir(folder)
    assert not shapes.add(KEYS[0])
    assert shapes.write_failures == 1
