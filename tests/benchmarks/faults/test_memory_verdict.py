"""The soak's memory check: GPU memory a process's allocator keeps freed for reuse is not taken
for a leak, up to a bound of its own; memory handed out and never given back is."""

from benchmarks.faults.verdict import CACHE_SHARE, memory_check

GIB = 2**30


def _snapshot(gpu: int, device: int, held: int | None = None, in_use: int | None = None) -> dict:
    engine = {"pid": 1, "anon_bytes": GIB, "gpu_bytes": gpu}
    if held is not None:
        engine["allocator"] = {"held": held, "in_use": in_use}
    return {"processes": {"engine": engine,
                          "daemon": {"pid": 2, "anon_bytes": GIB, "engine_arena_bytes": 0}},
            "device_used_bytes": [device]}


def _items(check: dict) -> dict:
    return {item["what"]: item for item in check["items"]}


def test_growth_that_is_the_allocators_cache_passes_and_is_reported() -> None:
    before = _snapshot(15 * GIB, 16 * GIB, held=2 * GIB, in_use=2 * GIB)
    after = _snapshot(16 * GIB + GIB // 2, 17 * GIB + GIB // 2, held=3 * GIB + GIB // 2,
                      in_use=2 * GIB)  # 1.5 GiB more, all of it freed blocks kept for reuse
    check = memory_check(before, after, tolerance=0.05, slack_bytes=64 * 2**20)
    items = _items(check)
    assert check["ok"]
    assert items["engine allocator cache"] == {"what": "engine allocator cache", "before": 0,
                                               "after": GIB + GIB // 2,
                                               "limit": int(CACHE_SHARE * 15 * GIB), "ok": True}
    assert items["engine gpu_bytes less its allocator cache"]["after"] == 15 * GIB
    assert items["device used_bytes less the allocator caches"]["after"] == 16 * GIB
    assert "engine gpu_bytes" not in items


def test_growth_in_memory_handed_out_fails() -> None:
    before = _snapshot(15 * GIB, 16 * GIB, held=2 * GIB, in_use=2 * GIB)
    after = _snapshot(16 * GIB + GIB // 2, 17 * GIB + GIB // 2, held=3 * GIB + GIB // 2,
                      in_use=3 * GIB + GIB // 2)  # the same growth, all of it still in use
    check = memory_check(before, after, tolerance=0.05, slack_bytes=64 * 2**20)
    items = _items(check)
    assert not check["ok"]
    assert not items["engine gpu_bytes less its allocator cache"]["ok"]
    assert not items["device used_bytes less the allocator caches"]["ok"]


def test_a_process_without_an_allocator_reading_is_judged_whole() -> None:
    before = _snapshot(15 * GIB, 16 * GIB)
    after = _snapshot(16 * GIB + GIB // 2, 17 * GIB + GIB // 2)
    check = memory_check(before, after, tolerance=0.05, slack_bytes=64 * 2**20)
    items = _items(check)
    assert not check["ok"]
    assert not items["engine gpu_bytes"]["ok"]
    assert "engine allocator cache" not in items
    # One side without a reading (an engine that could not answer /metrics): judged whole too.
    after = _snapshot(16 * GIB + GIB // 2, 17 * GIB + GIB // 2, held=3 * GIB, in_use=GIB)
    assert not _items(memory_check(before, after, 0.05, 64 * 2**20))["engine gpu_bytes"]["ok"]


def test_a_cache_past_its_bound_fails_even_when_the_rest_is_back() -> None:
    before = _snapshot(15 * GIB, 16 * GIB, held=2 * GIB, in_use=2 * GIB)
    cache = 5 * GIB  # more than a quarter of the engine's 15 GiB: a pool that only grows
    after = _snapshot(15 * GIB + cache, 16 * GIB + cache, held=2 * GIB + cache, in_use=2 * GIB)
    check = memory_check(before, after, tolerance=0.05, slack_bytes=64 * 2**20)
    items = _items(check)
    assert items["engine gpu_bytes less its allocator cache"]["ok"]
    assert not items["engine allocator cache"]["ok"] and not check["ok"]
