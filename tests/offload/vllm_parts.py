"""What the vLLM end-to-end tests share: prompts, vLLM's CPU block size, logprob comparison."""

from __future__ import annotations

BLOCK_SIZE = 128  # vLLM's CPU default; the connector reads it from vLLM, the tests only count


def prompt(seed: int, num_tokens: int = 1000) -> list[int]:
    """Token ids that no other seed shares a block with."""
    return [(seed * 7919 + i * 104729) % 4500 + 10 for i in range(num_tokens)]


def full_blocks_tokens(num_tokens: int) -> int:
    """Tokens a store hit can cover: vLLM computes the last prompt token itself."""
    return (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def assert_same_logprobs(got: dict, want: dict, tol: float = 1e-5) -> None:
    """The same greedy tokens and, per step, the same top logprobs within ``tol``."""
    assert got["token_ids"] == want["token_ids"]
    for g, w in zip(got["logprobs"], want["logprobs"]):
        assert g.keys() == w.keys()
        for tok, lp in w.items():
            assert abs(g[tok] - lp) <= tol, (tok, g[tok], lp)
