"""Cost-aware restore: load a cached prefix only when it is expected to beat recomputing it.

Both sides of the comparison are measured online: the store's bandwidth per tier from completed
loads, the engine's prefill rate from the steps it runs. Until a side has been measured, its prior
is used (priors lean towards restoring, since a restore that turns out slow is what measures it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class _Ema:
    value: float
    samples: int = 0

    def update(self, sample: float, alpha: float) -> None:
        self.value = sample if self.samples == 0 else (1 - alpha) * self.value + alpha * sample
        self.samples += 1


class RestorePolicy:
    """Online estimates of tier bandwidth and prefill speed, and the restore decision they imply."""

    def __init__(self, prior_bytes_per_s: dict[str, float], prior_prefill_tokens_per_s: float,
                 fixed_overhead_s: float = 0.0005, alpha: float = 0.2) -> None:
        self._lock = threading.Lock()
        self._alpha = alpha
        self._fixed_overhead_s = fixed_overhead_s
        self._bandwidth = {tier: _Ema(bw) for tier, bw in prior_bytes_per_s.items()}
        self._prefill = _Ema(prior_prefill_tokens_per_s)

    def observe_load(self, tier: str, num_bytes: int, seconds: float) -> None:
        """A load of ``num_bytes`` from ``tier`` completed in ``seconds`` (round trip included)."""
        if num_bytes <= 0 or seconds <= 0:
            return
        with self._lock:
            ema = self._bandwidth.setdefault(tier, _Ema(num_bytes / seconds))
            ema.update(num_bytes / seconds, self._alpha)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A prefill step computed ``num_tokens`` in ``seconds``."""
        if num_tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            self._prefill.update(num_tokens / seconds, self._alpha)

    def expected_load_s(self, tier: str, num_bytes: int) -> float:
        with self._lock:
            ema = self._bandwidth.get(tier)
            bandwidth = ema.value if ema is not None else min(
                e.value for e in self._bandwidth.values())
        return self._fixed_overhead_s + num_bytes / bandwidth

    def expected_prefill_s(self, num_tokens: int) -> float:
        with self._lock:
            return num_tokens / self._prefill.value

    def should_restore(self, tier: str, num_tokens: int, num_bytes: int) -> bool:
        """True when loading ``num_bytes`` from ``tier`` beats recomputing ``num_tokens``."""
        if num_tokens <= 0:
            return False
        return self.expected_load_s(tier, num_bytes) < self.expected_prefill_s(num_tokens)

    def snapshot(self) -> dict:
        with self._lock:
            return {"bandwidth_bytes_per_s": {t: e.value for t, e in self._bandwidth.items()},
                    "prefill_tokens_per_s": self._prefill.value}
