"""RoutingPolicy: which engine a request goes to, and why.

With ``kv`` (the default) a request goes to the engine holding the longest prefix of its block
chain in HBM (as the kvstore daemon's ``locate`` reports it); engines holding equally much are
ties, and a tie, a prefix the node holds only in DRAM/SSD, and a miss all go to the least loaded
engine. An HBM holder busier than the least loaded engine by more than ``load_slack`` requests
is passed over for it (a prefix every request shares, such as a system prompt, would otherwise
send everything to one engine). Without an answer from the daemon, the least loaded engine.
``round-robin`` and ``least-loaded`` ignore where blocks are.

Least loaded: fewest requests in flight; equally loaded engines take turns. Plain data in,
a ``Route`` out: no IO here.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

ROUTING_MODES = ("kv", "round-robin", "least-loaded")


class RouteReason(str, enum.Enum):
    """Why a request went where it went (the router's metrics count each)."""

    HBM_HIT = "hbm_hit"  # to the engine holding the longest prefix in HBM
    HBM_BUSY = "hbm_busy"  # that engine was over the load slack: to the least loaded
    DRAM_HIT = "dram_hit"  # no engine holds any of it in HBM, the store does: least loaded
    MISS = "miss"  # held nowhere (or no prompt to look up): least loaded
    FALLBACK = "fallback"  # the daemon did not answer in time: least loaded
    ROUND_ROBIN = "round_robin"  # --routing round-robin
    LEAST_LOADED = "least_loaded"  # --routing least-loaded


@dataclass(frozen=True)
class Candidate:
    """A ready engine as the policy sees it: its load and the leading blocks it holds in HBM."""

    name: str
    load: int
    num_hbm: int = 0


@dataclass(frozen=True)
class Route:
    """The chosen engine, why, and how many leading blocks it is expected to find cached
    anywhere on the node (its HBM, a peer's, DRAM or SSD)."""

    name: str
    reason: RouteReason
    expected_hit_blocks: int = 0


class RoutingPolicy:
    """One router's policy; ``choose`` is called on the event loop (not thread-safe)."""

    def __init__(self, mode: str = "kv", load_slack: int = 8) -> None:
        if mode not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {ROUTING_MODES}, got {mode!r}")
        if load_slack < 0:
            raise ValueError(f"load_slack must be >= 0, got {load_slack}")
        self.mode = mode
        self.load_slack = load_slack
        self._turns = itertools.count()

    @property
    def uses_kv(self) -> bool:
        """Whether ``choose`` wants to know where the blocks are."""
        return self.mode == "kv"

    def choose(self, candidates: Sequence[Candidate], num_stored: int | None = None) -> Route:
        """The route among ``candidates`` (at least one). ``num_stored``: leading blocks the
        store holds (DRAM or SSD); None when the daemon gave no answer (kv mode: fallback)."""
        if not candidates:
            raise ValueError("no candidate engine")
        if self.mode == "round-robin":
            return Route(candidates[next(self._turns) % len(candidates)].name,
                         RouteReason.ROUND_ROBIN)
        if self.mode == "least-loaded":
            return Route(self.least_loaded(candidates).name, RouteReason.LEAST_LOADED)
        if num_stored is None:
            return Route(self.least_loaded(candidates).name, RouteReason.FALLBACK)
        best = max(c.num_hbm for c in candidates)
        expected = max(best, num_stored)
        if best == 0:
            reason = RouteReason.DRAM_HIT if num_stored else RouteReason.MISS
            return Route(self.least_loaded(candidates).name, reason, expected)
        holder = self.least_loaded([c for c in candidates if c.num_hbm == best])
        lightest = min(c.load for c in candidates)
        if holder.load - lightest > self.load_slack:
            return Route(self.least_loaded(candidates).name, RouteReason.HBM_BUSY, expected)
        return Route(holder.name, RouteReason.HBM_HIT, expected)

    def least_loaded(self, candidates: Sequence[Candidate]) -> Candidate:
        """The candidate with the fewest requests in flight; equally loaded ones take turns."""
        lightest = min(c.load for c in candidates)
        tied = [c for c in candidates if c.load == lightest]
        return tied[next(self._turns) % len(tied)] if len(tied) > 1 else tied[0]
