"""The verdict of a fault soak, from its JSON parts: answers, failures, faults, memory.

Pure functions over the records (``ChatRecord.to_json()``), the schedule (``Fault.to_json()``),
the fault outcomes (``FaultInjector``) and two memory snapshots (``process_memory.snapshot``), so
a result file can be judged again, and a test can change one record and see the verdict turn.

Checks (all must hold):

- ``differences_only_numerics``: every answered request got the reference engine's answer to
  the same messages, character for character, or one the reference scores, token by token on
  its own prefix, within the stated margin of its best (``benchmarks.faults.answer_scoring``: a
  near-tie that bf16 rounding tipped the other way, not wrong KV); an unscored difference
  counts against the run;
- ``every_answer_compared``: the reference answered every one of them (at least one);
- ``no_failures_but_in_flight_at_engine_stops``: a failed request was in flight when an
  ``engine-term`` or ``engine-kill`` fault took its engine away, or it counts against the run;
- ``every_fault_applied``: the whole schedule ran, each fault recovered;
- ``served_after_every_fault``: some request sent after each fault's recovery was answered;
- ``store_used``: some prompt tokens were restored from the daemon (DRAM or SSD): the offload
  path was exercised, not only the engine's own cache;
- ``memory_back_to_baseline``: see ``memory_check``.
"""

from __future__ import annotations

from benchmarks.common import percentile
from benchmarks.faults.schedule import FaultKind

STORE_TIERS = ("dram", "ssd")


def compare_answers(records: list[dict]) -> dict:
    """Answered, compared and differing requests (indexes of the differences, and of those the
    reference's scoring does not explain), and the largest margin a difference used."""
    answered = [r for r in records if r["error"] is None]
    compared = [r for r in answered if r["reference"] is not None]
    differing = [r for r in compared if r["answer"] != r["reference"]]
    scores = [r.get("numerics") or {} for r in differing]
    return {"answered": len(answered), "compared": len(compared),
            "differences": [r["index"] for r in differing],
            "unexplained": [r["index"] for r, s in zip(differing, scores, strict=True)
                            if not s.get("within")],
            "largest_margin": max((s["largest_margin"] for s in scores
                                   if s.get("largest_margin") is not None), default=None),
            "largest_share": max((s["largest_share"] for s in scores
                                  if s.get("largest_share") is not None), default=None),
            "median_spread": percentile([s["median_spread"] for s in scores
                                         if s.get("median_spread") is not None], 0.5),
            "not_compared": [r["index"] for r in answered if r["reference"] is None]}


def failures(records: list[dict], faults: list[dict]) -> dict:
    """Failed requests: allowed (in flight at an engine stop) or not, and their errors."""
    engine_stops = {f["index"] for f in faults if FaultKind(f["kind"]).stops_engine}
    failed = [r for r in records if r["error"] is not None]
    allowed = [r["index"] for r in failed if r["in_flight_at_fault"] in engine_stops]
    errors: dict[str, int] = {}
    for r in failed:
        errors[r["error"][:80]] = errors.get(r["error"][:80], 0) + 1
    return {"failed": len(failed), "allowed": allowed,
            "not_allowed": [r["index"] for r in failed if r["index"] not in set(allowed)],
            "errors": errors}


def _e2e(records: list[dict]) -> dict:
    times = [r["e2e_s"] for r in records if r["error"] is None and r["e2e_s"] is not None]
    return {"num": len(records), "failed": sum(r["error"] is not None for r in records),
            "e2e_s_p50": percentile(times, 0.5), "e2e_s_p99": percentile(times, 0.99),
            "e2e_s_max": max(times, default=None)}


def fault_windows(records: list[dict], outcomes: list[dict], end_s: float) -> dict:
    """Per fault: the requests that overlapped it (sent before it recovered, done after it
    began) and their latencies, the answered requests sent after it recovered (before the next
    fault); and the latencies of the requests that overlapped no fault."""
    def overlaps(r: dict, start: float, stop: float) -> bool:
        return r["sent_s"] <= stop and r["sent_s"] + (r["e2e_s"] or 0.0) >= start

    per_fault = []
    for i, o in enumerate(outcomes):
        next_s = outcomes[i + 1]["at_s"] if i + 1 < len(outcomes) else end_s
        during = [r for r in records if overlaps(r, o["at_s"], o["ended_s"])]
        after = [r for r in records if o["ended_s"] <= r["sent_s"] < next_s]
        per_fault.append({"index": o["index"], "kind": o["kind"], "at_s": o["at_s"],
                          "recovered_s": round(o["ended_s"] - o["at_s"], 3),
                          "during": _e2e(during),
                          "answered_after": sum(r["error"] is None for r in after)})
    quiet = [r for r in records
             if not any(overlaps(r, o["at_s"], o["ended_s"]) for o in outcomes)]
    return {"faults": per_fault, "outside_faults": _e2e(quiet)}


# The freed blocks an allocator keeps may grow to this share of its process's baseline GPU
# memory (the largest step's intermediates, kept for reuse); more is a pool that fragments or
# keeps what no step needs any more, and fails the check.
CACHE_SHARE = 0.25


def _allocator_cache(process: dict) -> int | None:
    """Bytes a process's device allocator holds but has not handed out (None: not reported)."""
    allocator = process.get("allocator") or {}
    if "held" not in allocator or "in_use" not in allocator:
        return None
    return max(0, allocator["held"] - allocator["in_use"])


def _less(value: int | None, cache: int) -> int | None:
    return None if value is None else value - cache


def memory_check(before: dict, after: dict, tolerance: float, slack_bytes: int) -> dict:
    """Each figure after the load against its baseline. Resident heap (``anon_bytes``) and GPU
    memory (per process, per device) may grow by ``tolerance`` x baseline + ``slack_bytes``
    (allocator caches); the engine arenas the daemon maps must be exactly the baseline's (it
    maps the live engine's arena, nothing of a dead one).

    Where a process reports its device allocator (``allocator``: ``held``, ``in_use``), its GPU
    memory and the device's are judged less the blocks that allocator keeps freed for reuse: the
    baseline is read after a single warm-up request, so the cache then is smaller than after a
    batch of long prompts, and a cache is sized by the largest step seen, not by what leaked.
    The cache itself is judged apart: it may grow to ``CACHE_SHARE`` of the process's baseline
    GPU memory (or stay at its baseline, if that was larger)."""
    items = []

    def add(what: str, b: int | None, a: int | None, exact: bool = False) -> None:
        if b is None or a is None:
            items.append({"what": what, "before": b, "after": a, "limit": None, "ok": None})
            return
        limit = b if exact else int(b * (1 + tolerance) + slack_bytes)
        items.append({"what": what, "before": b, "after": a, "limit": limit, "ok": a <= limit})

    procs_b, procs_a = before["processes"], after["processes"]
    cached_b = cached_a = 0  # freed blocks the processes' allocators keep for reuse
    for role in sorted(set(procs_b) | set(procs_a)):
        b, a = procs_b.get(role, {}), procs_a.get(role, {})
        add(f"{role} anon_bytes", b.get("anon_bytes"), a.get("anon_bytes"))
        if "gpu_bytes" not in b and "gpu_bytes" not in a:
            continue
        cache_b, cache_a = _allocator_cache(b), _allocator_cache(a)
        if cache_b is None or cache_a is None:
            add(f"{role} gpu_bytes", b.get("gpu_bytes"), a.get("gpu_bytes"))
            continue
        gpu_b = b.get("gpu_bytes")
        limit = None if gpu_b is None else max(cache_b, int(CACHE_SHARE * gpu_b))
        items.append({"what": f"{role} allocator cache", "before": cache_b, "after": cache_a,
                      "limit": limit, "ok": None if limit is None else cache_a <= limit})
        cached_b, cached_a = cached_b + cache_b, cached_a + cache_a
        add(f"{role} gpu_bytes less its allocator cache", _less(b.get("gpu_bytes"), cache_b),
            _less(a.get("gpu_bytes"), cache_a))
    daemon_b, daemon_a = procs_b.get("daemon", {}), procs_a.get("daemon", {})
    add("daemon engine_arena_bytes", daemon_b.get("engine_arena_bytes"),
        daemon_a.get("engine_arena_bytes"), exact=True)
    if before.get("device_used_bytes") is not None or after.get("device_used_bytes"):
        dev_b, dev_a = before.get("device_used_bytes"), after.get("device_used_bytes")
        add("device used_bytes less the allocator caches",
            None if dev_b is None else sum(dev_b) - cached_b,
            None if dev_a is None else sum(dev_a) - cached_a)
    judged = [i["ok"] for i in items if i["ok"] is not None]
    # A figure that could not be read is reported, not judged; none judged is no verdict.
    return {"items": items, "ok": bool(judged) and all(judged)}


def verdict(records: list[dict], faults: list[dict], outcomes: list[dict], memory_before: dict,
            memory_after: dict, tolerance: float, slack_bytes: int) -> dict:
    """Every check, its figures, and ``passed`` (all checks hold)."""
    answers = compare_answers(records)
    failed = failures(records, faults)
    end_s = max((r["sent_s"] + (r["e2e_s"] or 0.0) for r in records), default=0.0)
    windows = fault_windows(records, outcomes, end_s)
    memory = memory_check(memory_before, memory_after, tolerance, slack_bytes)
    restored = sum((r["cached_tokens_by_tier"] or {}).get(t, 0) for r in records
                   if r["error"] is None for t in STORE_TIERS)
    checks = {
        "differences_only_numerics": not answers["unexplained"],
        "every_answer_compared": answers["answered"] > 0 and not answers["not_compared"],
        "no_failures_but_in_flight_at_engine_stops": not failed["not_allowed"],
        "every_fault_applied": (len(outcomes) == len(faults)
                                and all(o["error"] is None for o in outcomes)),
        "served_after_every_fault": all(f["answered_after"] > 0 for f in windows["faults"]),
        "store_used": restored > 0,
        "memory_back_to_baseline": memory["ok"],
    }
    return {"passed": all(checks.values()), "checks": checks, "requests": len(records),
            "answers": answers, "failures": failed, "restored_tokens_from_store": restored,
            "fault_windows": windows, "memory": memory}
