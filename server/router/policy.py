"""RoutingPolicy: which engine a request goes to, and why.

With ``kv`` (the default) a request goes where its first token is expected soonest. For each
ready engine the estimate is, in seconds: the work (prefill and restores) the router has sent
there and not yet seen answered (``queued_s``, each request's own part of its estimate when it
was sent: a restore occupies the engine's copies and HBM as a prefill does its compute), plus
this request's tokens
priced by where they sit: the leading blocks in the engine's own HBM are free; each later block
costs the cheapest of restoring it from where the node holds it (a peer engine's HBM, the
node's DRAM, its SSD) and computing it, at that engine's measured restore and prefill rates
(``EngineCosts``, from its ``/load``); the rest is computed. So a conversation stays on the
engine that holds it until that engine's queue costs more than restoring the prefix elsewhere,
and a prefix every request shares (a system prompt) is worth only the restore it saves, not a
whole queue: new conversations spread. Estimates within ``TIE_S`` of the best are ties: the
engine holding the most in HBM (a conversation stays where it is warm), then the one with the
fewest requests in flight, equal ones taking turns. A prompt mostly new (no
engine holds half of it) widens the tie to what the best holder's HBM saves, so a shared head
never concentrates new conversations on one engine even when they arrive one at a time (llm-d
dropped its weighted blend for this after it hot-spotted on shared prefixes). Without an
answer from the daemon, the least loaded engine. ``round-robin`` and ``least-loaded`` ignore
where blocks are.

Least loaded: fewest requests in flight; equally loaded engines take turns. Plain data in,
a ``Route`` out: no IO here.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

ROUTING_MODES = ("kv", "round-robin", "least-loaded")
# Estimates closer than this to the best are ties (a cold prompt on idle engines: all equal).
TIE_S = 0.002
# Where a restored block comes from, in the order an engine's restore reads the node.
PEER_HBM, DRAM, SSD = "hbm", "dram", "ssd"


class RouteReason(str, enum.Enum):
    """Why a request went where it went (the router's metrics count each)."""

    HBM_HIT = "hbm_hit"  # the chosen engine holds the longest prefix in its own HBM
    HBM_BUSY = "hbm_busy"  # another engine holds more in HBM, but its queue costs more
    DRAM_HIT = "dram_hit"  # no engine holds any of it in HBM, the store does
    MISS = "miss"  # held nowhere (or no prompt to look up): spread by queue and load
    FALLBACK = "fallback"  # the daemon did not answer in time: least loaded
    ROUND_ROBIN = "round_robin"  # --routing round-robin
    LEAST_LOADED = "least_loaded"  # --routing least-loaded


@dataclass(frozen=True)
class EngineCosts:
    """An engine's measured costs: seconds per prompt token it computes, and seconds per token
    it restores from each source (``PEER_HBM``, ``DRAM``, ``SSD``). The defaults are the
    engines' own priors for a GPU (20k prompt tokens/s; 200, 20 and 1 GB/s) at Qwen3-4B's
    147 KiB of KV per token, used until an engine reports its own."""

    prefill_s_per_token: float = 1 / 2e4
    restore_s_per_token: Mapping[str, float] = field(default_factory=lambda: {
        PEER_HBM: 147456 / 2e11, DRAM: 147456 / 2e10, SSD: 147456 / 1e9})
    prefill_measured: bool = False  # False: the prior, until the engine has timed prefills
    restore_measured: frozenset[str] = frozenset()  # tiers whose rate the engine has timed

    @classmethod
    def from_report(cls, report: Mapping | None) -> EngineCosts:
        """From ``/load``'s ``costs`` (``prefill_tokens_per_s``, ``kv_bytes_per_token``,
        ``restore_bytes_per_s`` by tier); the defaults for what is missing or malformed."""
        default = cls()
        if not isinstance(report, Mapping):
            return default
        try:
            rate = float(report["prefill_tokens_per_s"])
            per_token = float(report["kv_bytes_per_token"])
            bandwidth = {str(k): float(v) for k, v in report["restore_bytes_per_s"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            return default
        if rate <= 0 or per_token <= 0:
            return default
        restore = dict(default.restore_s_per_token)
        restore.update({tier: per_token / bw for tier, bw in bandwidth.items() if bw > 0})
        measured = report.get("restore_measured", ())
        tiers = frozenset(str(t) for t in measured) if isinstance(measured, list) else frozenset()
        return cls(1.0 / rate, restore, bool(report.get("prefill_measured", True)), tiers)


@dataclass(frozen=True)
class Candidate:
    """A ready engine as the policy sees it: its base URL, requests in flight, the leading
    blocks it holds in HBM, the seconds of work (prefill and restores) the router sent it and
    has not seen answered, its costs."""

    url: str
    load: int
    num_hbm: int = 0
    queued_s: float = 0.0
    costs: EngineCosts = field(default_factory=EngineCosts)


@dataclass(frozen=True)
class Placement:
    """Where a prompt's blocks are on the node besides the engines' HBM: ``num_tokens`` of
    prompt, ``block_size`` tokens a block, the leading ``num_dram`` blocks in DRAM and the
    leading ``num_stored`` in DRAM or SSD."""

    num_tokens: int
    block_size: int
    num_dram: int = 0
    num_stored: int = 0


@dataclass(frozen=True)
class Route:
    """The chosen engine's URL, why, how many leading blocks it is expected to find cached
    anywhere on the node, the prompt tokens it is expected to compute, and its estimate
    (seconds)."""

    url: str
    reason: RouteReason
    expected_hit_blocks: int = 0
    compute_tokens: int = 0
    estimate_s: float = 0.0
    work_s: float = 0.0  # this request's own part of the estimate: it joins the engine's queue


@dataclass(frozen=True)
class Estimate:
    """One candidate's expected time to first token and what it is made of."""

    seconds: float
    cached_blocks: int  # own HBM plus the blocks restoring beats computing
    compute_tokens: int
    work_s: float  # ``seconds`` less the queue: this request's restores and prefill


def estimate(candidate: Candidate, peer_hbm: int, placement: Placement) -> Estimate:
    """``candidate``'s expected time to first token for ``placement``'s prompt, given that some
    other engine holds its leading ``peer_hbm`` blocks in HBM."""
    costs = candidate.costs
    prefill = costs.prefill_s_per_token
    seconds = 0.0
    bs = placement.block_size
    num_blocks = placement.num_tokens // bs
    own = min(candidate.num_hbm, num_blocks)
    sources = ((PEER_HBM, min(peer_hbm, num_blocks)), (DRAM, min(placement.num_dram, num_blocks)),
               (SSD, min(placement.num_stored, num_blocks)))
    cached, start = own, own
    for end in sorted({limit for _, limit in sources if limit > own}):
        per_token = min((costs.restore_s_per_token.get(tier, prefill)
                         for tier, limit in sources if limit >= end), default=prefill)
        if per_token >= prefill:
            break  # computing is cheaper: the engine would not restore past here either
        seconds += (end - start) * bs * per_token
        cached, start = end, end
    compute = placement.num_tokens - cached * bs
    work = seconds + compute * prefill
    return Estimate(candidate.queued_s + work, cached, compute, work)


def _with_node_costs(candidates: Sequence[Candidate]) -> Sequence[Candidate]:
    """Every engine priced at the median rates of those that have measured them: a node's
    engines run one model on alike devices, and one engine's estimate is noisy for its first
    minute (two H200s measured 12k and 36k tokens/s for the same prefills; the router then sent
    new conversations behind a queue on the "faster" one, 1.2-2.5 s first tokens). The same for
    each restore tier: an engine that has not restored yet still has its prior (20 GB/s from
    DRAM), and beside one that measured 46 GB/s it looked twice as slow to restore the same
    blocks, so two H200s' later turns all went to one of them. Engines keep their priors only
    while none has measured."""
    measured = sorted(c.costs.prefill_s_per_token for c in candidates
                      if c.costs.prefill_measured)
    prefill = measured[len(measured) // 2] if measured else None
    restore: dict[str, float] = {}
    for tier in {t for c in candidates for t in c.costs.restore_measured}:
        rates = sorted(c.costs.restore_s_per_token[tier] for c in candidates
                       if tier in c.costs.restore_measured and tier in c.costs.restore_s_per_token)
        if rates:
            restore[tier] = rates[len(rates) // 2]
    if prefill is None and not restore:
        return candidates
    out = []
    for c in candidates:
        costs = c.costs
        if prefill is not None:
            costs = replace(costs, prefill_s_per_token=prefill)
        if restore:
            costs = replace(costs, restore_s_per_token={**costs.restore_s_per_token, **restore})
        out.append(replace(c, costs=costs))
    return out


class RoutingPolicy:
    """One router's policy; ``choose`` is called on the event loop (not thread-safe)."""

    def __init__(self, mode: str = "kv") -> None:
        if mode not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {ROUTING_MODES}, got {mode!r}")
        self.mode = mode
        # Whose turn it is, per tenant: one tenant's alternation must not reveal whether
        # another's requests went elsewhere (were hits). Tenants are the API keys' salts.
        self._turns: dict[str, itertools.count] = {}

    @property
    def uses_kv(self) -> bool:
        """Whether ``choose`` wants to know where the blocks are."""
        return self.mode == "kv"

    def choose(self, candidates: Sequence[Candidate], placement: Placement | None,
               tenant: str = "") -> Route:
        """The route among ``candidates`` (at least one). ``placement``: where the prompt's
        blocks are; None when the daemon gave no answer (kv mode: fallback). ``tenant``: whose
        turns break ties."""
        if not candidates:
            raise ValueError("no candidate engine")
        if self.mode == "round-robin":
            return Route(candidates[self._turn(tenant) % len(candidates)].url,
                         RouteReason.ROUND_ROBIN)
        if self.mode == "least-loaded":
            return Route(self.least_loaded(candidates, tenant).url, RouteReason.LEAST_LOADED)
        if placement is None:
            return Route(self.least_loaded(candidates, tenant).url, RouteReason.FALLBACK)
        return self._cheapest(candidates, placement, tenant)

    def _turn(self, tenant: str) -> int:
        turns = self._turns.get(tenant)
        if turns is None:
            turns = self._turns[tenant] = itertools.count()
        return next(turns)

    def _cheapest(self, candidates: Sequence[Candidate], placement: Placement,
                  tenant: str) -> Route:
        candidates = _with_node_costs(candidates)
        hbm = sorted((c.num_hbm for c in candidates), reverse=True)
        estimates = []
        for c in candidates:
            # the longest prefix another engine holds: the top one, or the runner-up's for it
            peer = hbm[1] if len(hbm) > 1 and c.num_hbm == hbm[0] else hbm[0]
            estimates.append((c, estimate(c, 0 if len(hbm) == 1 else peer, placement)))
        best = min(e.seconds for _, e in estimates)
        held_tokens = hbm[0] * placement.block_size
        if 2 * held_tokens < placement.num_tokens:
            # Mostly new (what any engine holds is a shared head, such as a system prompt): its
            # holder's saving is not worth concentrating new conversations (their later turns,
            # their decode rows) on it; spread them by load among engines that come close.
            window = max(TIE_S, held_tokens * max(c.costs.prefill_s_per_token
                                                  for c in candidates))
            chosen = self.least_loaded([c for c, e in estimates if e.seconds <= best + window],
                                       tenant)
        else:  # a conversation: among ties, it stays where it is warm
            tied = [c for c, e in estimates if e.seconds <= best + TIE_S]
            warmest = max(c.num_hbm for c in tied)
            chosen = self.least_loaded([c for c in tied if c.num_hbm == warmest], tenant)
        chosen_estimate = next(e for c, e in estimates if c is chosen)
        if hbm[0] == 0:
            reason = RouteReason.DRAM_HIT if placement.num_stored else RouteReason.MISS
        elif chosen.num_hbm == hbm[0]:
            reason = RouteReason.HBM_HIT
        else:
            reason = RouteReason.HBM_BUSY
        return Route(chosen.url, reason, chosen_estimate.cached_blocks,
                     chosen_estimate.compute_tokens, chosen_estimate.seconds,
                     chosen_estimate.work_s)

    def least_loaded(self, candidates: Sequence[Candidate], tenant: str = "") -> Candidate:
        """The candidate with the fewest requests in flight; equally loaded ones take turns
        (``tenant``'s turns)."""
        lightest = min(c.load for c in candidates)
        tied = [c for c in candidates if c.load == lightest]
        return tied[self._turn(tenant) % len(tied)] if len(tied) > 1 else tied[0]
