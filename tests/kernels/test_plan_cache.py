"""The cuDNN plan cache's file store (kernels/plan_cache.py) and the build log, on CPU: what is
loaded is only what this user wrote, intact; every disk fault is a miss or a counted failure."""

from __future__ import annotations

import os

import pytest

from kernels.build_log import CUDA_GRAPH, CUDNN_GRAPH, BuildLog
from kernels.plan_cache import ENV, MAGIC, PlanCache, default_directory


def test_a_stored_plan_comes_back_byte_exact(tmp_path) -> None:
    cache = PlanCache(tmp_path / "plans")
    name = PlanCache.name(("decode", 4, 128), ("frontend", 1, "H200"))
    assert cache.get(name) is None and cache.counts["miss"] == 1
    blob = os.urandom(5000)
    assert cache.put(name, blob)
    assert PlanCache(tmp_path / "plans").get(name) == blob  # another start reads it
    assert (tmp_path / "plans").stat().st_mode & 0o777 == 0o700
    assert not [p for p in (tmp_path / "plans").iterdir() if p.name.startswith(".tmp-")]


def test_names_differ_by_key_and_setup() -> None:
    a = PlanCache.name(("decode", 4, 128), ("fe", 1, "H200"))
    assert a != PlanCache.name(("decode", 4, 256), ("fe", 1, "H200"))
    assert a != PlanCache.name(("decode", 4, 128), ("fe", 1, "H100"))
    assert a == PlanCache.name(("decode", 4, 128), ("fe", 1, "H200"))


@pytest.mark.parametrize("damage", ["truncated", "flipped", "foreign", "empty"])
def test_a_damaged_entry_is_deleted_and_rebuilt_never_loaded(tmp_path, damage) -> None:
    cache = PlanCache(tmp_path)
    cache.put("p", b"x" * 1000)
    path = tmp_path / "p"
    data = path.read_bytes()
    path.write_bytes({"truncated": data[:-10], "flipped": data[:-1] + b"y",
                      "foreign": b"\x7fELF" + data[4:], "empty": b""}[damage])
    assert cache.get("p") is None
    assert cache.counts["corrupt"] == 1 and not path.exists()
    assert data.startswith(MAGIC)


def test_a_directory_others_can_write_is_not_used(tmp_path, caplog) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    cache = PlanCache(shared)
    assert not cache.enabled and "writable by group or others" in cache.reason
    assert cache.get("p") is None and not cache.put("p", b"blob")
    assert not list(shared.iterdir())


def test_a_file_in_place_of_the_directory_turns_the_cache_off(tmp_path) -> None:
    (tmp_path / "f").write_text("x")
    cache = PlanCache(tmp_path / "f")
    assert not cache.enabled and cache.reason


def test_a_write_that_fails_is_counted_and_the_plan_still_serves(tmp_path) -> None:
    cache = PlanCache(tmp_path / "plans")
    (tmp_path / "plans").rmdir()  # removed under a running engine (as a full disk fails writes)
    assert not cache.put("p", b"blob")
    assert cache.counts["write_failed"] == 1
    assert cache.get("p") is None and cache.counts["miss"] == 1


def test_the_least_recently_used_entries_go_past_the_bound(tmp_path) -> None:
    cache = PlanCache(tmp_path, max_entries=3)
    for i in range(3):
        cache.put(f"p{i}", b"blob")
        os.utime(tmp_path / f"p{i}", (1000 + i, 1000 + i))
    assert cache.get("p0") == b"blob"  # used: now the newest
    cache.put("p3", b"blob")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p0", "p2", "p3"]
    assert cache.counts["evicted"] == 1


def test_the_environment_names_the_directory_or_turns_it_off(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(ENV, "off")
    assert default_directory() is None
    assert PlanCache(default_directory()).enabled is False
    monkeypatch.setenv(ENV, str(tmp_path / "d"))
    assert default_directory() == tmp_path / "d"
    monkeypatch.delenv(ENV)
    assert default_directory().parts[-2:] == ("kvstore", "cudnn-plans")


def test_builds_after_the_seal_are_first_use_costs(caplog) -> None:
    ticks = iter([0.0, 0.2, 1.0, 1.05])
    log = BuildLog(clock=lambda: next(ticks))
    with log.building(CUDNN_GRAPH, ("decode", 1, 16)):
        pass
    log.seal()
    with caplog.at_level("WARNING", logger="kernels.builds"), \
            log.building(CUDA_GRAPH, ("decode", 4, 64)):
        pass
    snap = log.snapshot()
    assert snap["before"] == {CUDNN_GRAPH: 1} and snap["after"] == {CUDA_GRAPH: 1}
    assert snap["seconds_after"][CUDA_GRAPH] == pytest.approx(0.05)
    assert "first-use build after ready" in caplog.text and "('decode', 4, 64)" in caplog.text


def test_a_build_beside_a_device_step_is_counted_apart_and_not_a_stall(caplog) -> None:
    log = BuildLog()
    log.seal()
    with caplog.at_level("WARNING", logger="kernels.builds"):
        log.record_hidden(CUDNN_GRAPH, ("prefill", 2, 1024), 0.006)
    snap = log.snapshot()
    assert snap["after"] == {} and snap["hidden"] == {CUDNN_GRAPH: 1}
    assert snap["seconds_hidden"][CUDNN_GRAPH] == pytest.approx(0.006)
    assert "first-use build after ready" not in caplog.text


def test_a_failed_build_is_not_counted() -> None:
    log = BuildLog()
    with pytest.raises(RuntimeError), log.building(CUDNN_GRAPH, "refused"):
        raise RuntimeError("cuDNN refuses the shape")
    assert log.snapshot()["before"] == {}
