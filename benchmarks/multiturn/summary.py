"""What a multi-turn run measured, as numbers and as text: TTFT, inter-token latency, end-to-end
time, throughput and cache hit rates by tier, overall and per round."""

from __future__ import annotations

import statistics

from benchmarks.common import percentile
from benchmarks.multiturn.request_record import RequestRecord

TIERS = ("hbm", "dram", "ssd", "remote")


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def _hits(records: list[RequestRecord]) -> dict:
    """Cached fraction of prompt tokens, overall and by tier, over records with usage."""
    with_usage = [r for r in records if r.prompt_tokens]
    prompt = sum(r.prompt_tokens for r in with_usage)
    cached = sum(r.cached_tokens or 0 for r in with_usage)
    by_tier = {t: sum((r.cached_tokens_by_tier or {}).get(t, 0) for r in with_usage)
               for t in TIERS}
    return {"prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else None,
            "hit_rate_by_tier": {t: (n / prompt if prompt else None) for t, n in by_tier.items()}}


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    """TTFT, ITL, end-to-end time, throughput and hit rates, overall and per round."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok]
    itls = [x for r in ok for x in r.itl_s]
    # Time per output token after the first: ITL per token even where a chunk carries several.
    tpots = [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in ok
             if r.completion_tokens and r.completion_tokens > 1]
    out = {
        "num_requests": len(records), "num_ok": len(ok), "num_errors": len(records) - len(ok),
        "wall_s": wall_s,
        "ttft_ms": {"mean": _ms(statistics.fmean(ttfts)) if ttfts else None,
                    "p50": _ms(percentile(ttfts, 0.5)), "p90": _ms(percentile(ttfts, 0.9)),
                    "p99": _ms(percentile(ttfts, 0.99))},
        "itl_ms": {"p50": _ms(percentile(itls, 0.5)), "p99": _ms(percentile(itls, 0.99))},
        "tpot_ms": {"mean": _ms(statistics.fmean(tpots)) if tpots else None},
        "e2e_ms": {"mean": _ms(statistics.fmean([r.e2e_s for r in ok])) if ok else None},
        "throughput": {
            "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
            "output_tokens_per_s": (sum(r.completion_tokens or 0 for r in ok) / wall_s
                                    if wall_s > 0 else None),
            "prompt_tokens_per_s": (sum(r.prompt_tokens or 0 for r in ok) / wall_s
                                    if wall_s > 0 else None)},
        "hits": _hits(ok),
        "errors": sorted({r.error for r in records if r.error})[:10],
    }
    rounds = []
    for rnd in sorted({r.round for r in records}):
        in_round = [r for r in records if r.round == rnd]
        good = [r for r in in_round if r.ok]
        t = [r.ttft_s for r in good]
        rounds.append({"round": rnd, "num_requests": len(in_round), "num_ok": len(good),
                       "prompt_tokens_mean": (statistics.fmean([r.prompt_tokens or 0 for r in good])
                                              if good else None),
                       "ttft_ms_mean": _ms(statistics.fmean(t)) if t else None,
                       "ttft_ms_p50": _ms(percentile(t, 0.5)), **_hits(good)})
    out["rounds"] = rounds
    return out


def fmt_num(value: float | None, spec: str = "8.1f") -> str:
    """`value` formatted with `spec`, or a right-aligned '-' for None."""
    width = int(spec.split(".")[0]) if spec[0].isdigit() else 8
    return format(value, spec) if value is not None else "-".rjust(width)


def format_summary(summary: dict) -> str:
    """The summary as a small text table."""
    t, hits = summary["ttft_ms"], summary["hits"]
    tp = summary["throughput"]
    lines = [
        f"requests {summary['num_ok']}/{summary['num_requests']} ok, "
        f"{summary['num_errors']} errors, {summary['wall_s']:.1f} s",
        f"TTFT ms  mean {fmt_num(t['mean'])}  p50 {fmt_num(t['p50'])}  p99 {fmt_num(t['p99'])}   "
        f"ITL ms p50 {fmt_num(summary['itl_ms']['p50'], '7.2f')}  "
        f"TPOT ms {fmt_num(summary['tpot_ms']['mean'], '7.2f')}",
        f"throughput {fmt_num(tp['requests_per_s'], '.2f')} req/s, "
        f"{fmt_num(tp['output_tokens_per_s'], '.1f')} output tok/s, "
        f"{fmt_num(tp['prompt_tokens_per_s'], '.0f')} prompt tok/s; "
        f"hit rate {fmt_num(hits['hit_rate'], '.3f')}",
        f"{'round':>5} {'ok':>4} {'prompt':>8} {'TTFT mean':>10} {'p50':>8} {'hit':>6} "
        + " ".join(f"{tier:>6}" for tier in TIERS),
    ]
    for r in summary["rounds"]:
        by_tier = r["hit_rate_by_tier"]
        lines.append(
            f"{r['round']:>5} {r['num_ok']:>4} {fmt_num(r['prompt_tokens_mean'], '8.0f')} "
            f"{fmt_num(r['ttft_ms_mean'], '10.1f')} {fmt_num(r['ttft_ms_p50'])} "
            f"{fmt_num(r['hit_rate'], '6.3f')} "
            + " ".join(fmt_num(by_tier[tier], "6.3f") for tier in TIERS))
    for error in summary["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
