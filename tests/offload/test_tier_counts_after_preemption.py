"""Per-tier cached-token counts stay those of a request's first admission.

A request preempted under HBM pressure and admitted again may be restored from the store the
second time. Its usage reports the prompt's cache hit as it was on arrival (``num_cached_tokens``
is set once), so the tier split must be frozen with it: before, the second restore's tiers were
subtracted from the first admission's total and the HBM count went negative (seen on an H100:
``{"hbm": -13264, "dram": 14288}`` for a 1,024-token hit).
"""

from __future__ import annotations

from offload_helpers import close_llm, offload_llm, random_prompt

from engine import SamplingParams


def test_tier_counts_are_never_negative_and_sum_to_the_hit(tiny_model_dir, make_daemon) -> None:
    daemon = make_daemon()
    llm = offload_llm(tiny_model_dir, daemon, num_kv_blocks=24, block_size=16,
                      kv_offload_restore="always")
    try:
        prompts = [random_prompt(200, 96, seed=s) for s in range(6)]
        params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        outs = llm.generate(prompts, params)
        again = llm.generate(prompts, params)  # hits, and more preemptions under pressure
        stats = llm.engine.stats()
    finally:
        close_llm(llm)
    assert stats["num_preemptions"] > 0
    for out in outs + again:
        assert all(n >= 0 for n in out.cached_tokens_by_tier.values()), out.cached_tokens_by_tier
        assert sum(out.cached_tokens_by_tier.values()) == out.num_cached_tokens
    assert any(out.num_cached_tokens for out in again)
