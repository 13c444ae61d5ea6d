"""Cost-aware restore: load a cached prefix only when it is expected to beat recomputing it.

Both sides of the comparison are measured online: the store's bandwidth per tier from completed
loads, the engine's step time from the steps it runs. A step without prefill costs a floor
(decode rows, sampling). A step with prefill costs a fixed part (an eager forward's launches) plus
a marginal cost per prefill token: the slope of a decayed least-squares line through recent
prefill steps, so a few small host-bound steps do not make large prefills look slow. Recomputing
``n`` cached tokens costs the request ``n`` marginal token costs. A restore costs the
load and, while other requests run, at least the step the request sits out: it joins the first
step that starts after its blocks landed. So a restore wins when
``max(load, step floor if busy) < n x marginal cost``. Until a side has been measured its prior is
used (priors lean towards restoring, since a restore that turns out slow is what measures it).

A load sample is the bytes a busy period of the engine's loads landed over the union of their
lifetimes (``load_periods.LoadBusyPeriods``). Recomputing is never estimated below the median
per-token cost of the last ``_BULK_SAMPLES`` large prefill steps (``_BULK_PREFILL_TOKENS`` or
more), and when busy a recompute is charged ``BUSY_RECOMPUTE_FACTOR`` times its own time (it
takes GPU time from the requests beside it; a load takes only bus time). The runs that set
these rules: docs/measurements.md, "Restore policy".
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass

# Steps computing fewer prefill tokens than this measure the floor, not the marginal cost.
_MIN_PREFILL_SAMPLE_TOKENS = 32
# Weight kept by the older prefill samples per new one (about the last 20 steps count).
_FIT_DECAY = 0.95
# A busy engine charges a recompute this many times its own prefill time (see above).
BUSY_RECOMPUTE_FACTOR = 2.0
# Prefill steps of at least this many tokens measure the bulk per-token cost (see above).
_BULK_PREFILL_TOKENS = 1024
_BULK_SAMPLES = 15  # per-token costs are medians of this many recent steps


class _LineFit:
    """Decayed least squares of seconds against prefill tokens; ``slope`` is None until the
    samples' token counts vary enough to tell slope from intercept."""

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float) -> None:
        d = _FIT_DECAY
        self.w, self.x, self.y = d * self.w + 1, d * self.x + x, d * self.y + y
        self.xx, self.xy = d * self.xx + x * x, d * self.xy + x * y

    @property
    def slope(self) -> float | None:
        if self.w < 2:
            return None
        var = self.xx / self.w - (self.x / self.w) ** 2
        mean = self.x / self.w
        if var <= (0.25 * mean) ** 2:  # token counts too alike: the slope is noise
            return None
        slope = (self.xy / self.w - mean * self.y / self.w) / var
        return slope if slope > 0 else None


@dataclass
class _Ema:
    value: float
    samples: int = 0

    def update(self, sample: float, alpha: float) -> None:
        self.value = sample if self.samples == 0 else (1 - alpha) * self.value + alpha * sample
        self.samples += 1


class RestorePolicy:
    """Online estimates of tier bandwidth, step floor and per-token prefill cost, and the restore
    decision they imply. Thread-safe."""

    def __init__(self, prior_bytes_per_s: dict[str, float], prior_prefill_tokens_per_s: float,
                 fixed_overhead_s: float = 0.0005, alpha: float = 0.2) -> None:
        self._lock = threading.Lock()
        self._alpha = alpha
        self._fixed_overhead_s = fixed_overhead_s
        self._bandwidth = {tier: _Ema(bw) for tier, bw in prior_bytes_per_s.items()}
        self._warmed: set[str] = set()  # tiers whose first (warm-up) load was seen
        self._step_floor = _Ema(0.0)  # seconds of a step without prefill
        self._prior_token_cost = 1.0 / prior_prefill_tokens_per_s
        # Seconds per prefill token above the floor of recent prefill steps (their median is
        # the fallback of the line's slope: robust to one slow step).
        self._token_costs: deque[float] = deque(maxlen=_BULK_SAMPLES)
        # the same, of the recent large prefill steps only
        self._bulk_token_costs: deque[float] = deque(maxlen=_BULK_SAMPLES)
        self._last_step_s = 0.0
        self._line = _LineFit()
        self.last_declined: dict | None = None  # the estimates of the last restore declined

    def observe_load(self, tier: str, num_bytes: int, seconds: float) -> None:
        """Loads moved ``num_bytes`` (mostly from ``tier``) in ``seconds`` of busy time (one
        busy period's sample, see above). A tier's first sample is its warm-up (mappings
        opened, kernels loaded on first use) and is not taken; the next replaces the prior."""
        if num_bytes <= 0 or seconds <= 0:
            return
        with self._lock:
            if tier not in self._warmed:
                self._warmed.add(tier)
                return
            ema = self._bandwidth.setdefault(tier, _Ema(num_bytes / seconds))
            ema.update(num_bytes / seconds, self._alpha)

    def observe_step(self, num_prefill_tokens: int, seconds: float) -> None:
        """A step that computed ``num_prefill_tokens`` prompt tokens (besides any decode rows)
        took ``seconds``: a sample of the floor, or of the marginal cost above it."""
        if seconds <= 0 or num_prefill_tokens < 0:
            return
        with self._lock:
            self._last_step_s = seconds
            if num_prefill_tokens < _MIN_PREFILL_SAMPLE_TOKENS:
                self._step_floor.update(seconds, self._alpha)
                return
            # What the step cost beyond its floor; never less than a tenth of it (a floor
            # measured on larger decode batches than this step's must not make prefill free).
            above = max(seconds - self._step_floor.value, 0.1 * seconds)
            self._token_costs.append(above / num_prefill_tokens)
            if num_prefill_tokens >= _BULK_PREFILL_TOKENS:
                self._bulk_token_costs.append(above / num_prefill_tokens)
            self._line.add(num_prefill_tokens, seconds)

    def _seconds_per_token(self) -> float:
        slope = self._line.slope
        if slope is not None:
            estimate = slope
        elif self._token_costs:
            estimate = statistics.median(self._token_costs)
        else:
            estimate = self._prior_token_cost
        bulk = statistics.median(self._bulk_token_costs) if self._bulk_token_costs else 0.0
        return max(estimate, bulk)

    def expected_load_s(self, tier: str, num_bytes: int) -> float:
        with self._lock:
            ema = self._bandwidth.get(tier)
            bandwidth = ema.value if ema is not None else min(
                e.value for e in self._bandwidth.values())
        return self._fixed_overhead_s + num_bytes / bandwidth

    def expected_prefill_s(self, num_tokens: int) -> float:
        """What computing ``num_tokens`` more prompt tokens adds to a step."""
        with self._lock:
            return num_tokens * self._seconds_per_token()

    def last_step_s(self) -> float:
        """How long the engine's latest step took (0 before the first)."""
        with self._lock:
            return self._last_step_s

    def step_floor_s(self) -> float:
        """The time of a step without prefill (0 until one was measured)."""
        with self._lock:
            return self._step_floor.value

    def restore_wins(self, load_s: float, num_tokens: int, busy: bool) -> bool:
        """True when a restore that takes ``load_s`` beats recomputing ``num_tokens``; ``busy``:
        other requests are running, so the request also sits out the current step, and a
        recompute would also take its GPU time from them."""
        if num_tokens <= 0:
            return False
        wait_s = max(load_s, self.step_floor_s()) if busy else load_s
        return wait_s < self._charged_recompute_s(num_tokens, busy)

    def _charged_recompute_s(self, num_tokens: int, busy: bool) -> float:
        """What recomputing ``num_tokens`` is charged (twice its time when busy, see above)."""
        return self.expected_prefill_s(num_tokens) * (BUSY_RECOMPUTE_FACTOR if busy else 1.0)

    def note_declined(self, load_s: float, num_tokens: int, busy: bool) -> None:
        """Keep the estimates of a restore just declined (stats: why it lost)."""
        recompute_s = self._charged_recompute_s(num_tokens, busy)
        with self._lock:
            self.last_declined = {"load_s": load_s, "num_tokens": num_tokens, "busy": busy,
                                  "recompute_s": recompute_s,
                                  "step_floor_s": self._step_floor.value}

    def should_restore(self, tier: str, num_tokens: int, num_bytes: int,
                       busy: bool = False) -> bool:
        """True when loading ``num_bytes`` from ``tier`` beats recomputing ``num_tokens``."""
        return self.restore_wins(self.expected_load_s(tier, num_bytes), num_tokens, busy)

    def snapshot(self) -> dict:
        with self._lock:
            return {"bandwidth_bytes_per_s": {t: e.value for t, e in self._bandwidth.items()},
                    "bandwidth_measured": sorted(t for t, e in self._bandwidth.items()
                                                 if e.samples),
                    "prefill_tokens_per_s": 1.0 / self._seconds_per_token(),
                    "prefill_measured": bool(self._token_costs),
                    "step_floor_s": self._step_floor.value,
                    "last_declined": self.last_declined}
