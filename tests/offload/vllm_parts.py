"""What the vLLM end-to-end tests share: prompts, vLLM's CPU block size, logprob comparison,
starting a daemon and vLLM engines for a module."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from daemon_helpers import RunningDaemon, start_daemon

from kvstore.testing.vllm_process import VllmProcess

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


@contextmanager
def running_daemon(workdir: Path, **kwargs) -> Iterator[RunningDaemon]:
    """A ``kvstore serve`` (256 MiB of DRAM, no admin HTTP unless ``kwargs`` say otherwise),
    stopped afterwards."""
    daemon = start_daemon(workdir, **{"dram": "256MiB", "http": False, **kwargs})
    try:
        yield daemon
    finally:
        daemon.stop()


@contextmanager
def engines_up(procs: dict[str, VllmProcess]) -> Iterator[dict[str, VllmProcess]]:
    """vLLM engines started together (each start costs ~10 s), once every one is up; all are
    stopped afterwards."""
    try:
        for proc in procs.values():
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def dram_blocks(daemon: RunningDaemon) -> int:
    """Blocks the daemon's DRAM tier holds."""
    with daemon.client() as c:
        return int(c.stats()["tiers"]["dram"]["blocks"])
