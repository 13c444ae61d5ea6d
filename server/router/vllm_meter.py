"""VllmMeter: a vLLM engine's load and measured prefill rate, from its ``GET /metrics``.

vLLM has no ``/load``; its Prometheus text says what the router needs:

- load: ``vllm:num_requests_running`` plus ``vllm:num_requests_waiting`` (gauges, every label
  set summed);
- prefill rate: the prompt tokens it computed itself (``vllm:prompt_tokens_by_source{source=
  "local_compute"}``, a counter: not its prefix-cache hits, not what the connector loaded) over
  the time its requests spent in prefill (``vllm:request_prefill_time_seconds_sum``). Requests
  that prefill side by side each count their whole time, so this errs slow, as a queue does.

The rate is taken over everything since the first probe once ``MIN_TOKENS`` were computed (a
counter that went back, a restarted vLLM, starts it again); until then the engine keeps the
GPU priors (``EngineCosts``), marked unmeasured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from server.router.policy import EngineCosts

_RUNNING, _WAITING = b"vllm:num_requests_running", b"vllm:num_requests_waiting"
_COMPUTED = b"vllm:prompt_tokens_by_source_total"
_PREFILL_S = b"vllm:request_prefill_time_seconds_sum"
_NAMES = (_RUNNING, _WAITING, _COMPUTED, _PREFILL_S)
MIN_TOKENS = 512  # computed prompt tokens before the rate counts as measured


@dataclass(frozen=True)
class VllmSample:
    """One scrape: requests in flight, prompt tokens computed and prefill seconds so far."""

    load: int
    computed_tokens: float = 0.0
    prefill_s: float = 0.0


def parse_metrics(text: bytes) -> VllmSample:
    """The sample in a vLLM's Prometheus text; ValueError when it has neither load gauge (not a
    vLLM's /metrics)."""
    sums = dict.fromkeys(_NAMES, 0.0)
    seen = False
    for line in text.splitlines():
        if not line.startswith(_NAMES):
            continue
        close = line.rfind(b"}")  # label values may hold spaces; a timestamp may follow
        if close >= 0:
            name, labels, rest = line[:line.index(b"{")], line[:close], line[close + 1:]
        else:
            name, _, rest = line.partition(b" ")
            labels = b""
        if name not in sums or not rest.split():
            continue
        if name == _COMPUTED and b'source="local_compute"' not in labels:
            continue
        sums[name] += float(rest.split()[0])
        seen = seen or name in (_RUNNING, _WAITING)
    if not seen:
        raise ValueError("no vllm:num_requests_running or _waiting in its metrics")
    return VllmSample(int(sums[_RUNNING] + sums[_WAITING]), sums[_COMPUTED], sums[_PREFILL_S])


class VllmMeter:
    """One engine's costs from its samples (``update``)."""

    def __init__(self) -> None:
        self._first: VllmSample | None = None
        self.costs = EngineCosts()

    def update(self, sample: VllmSample) -> EngineCosts:
        first = self._first
        if first is None or sample.computed_tokens < first.computed_tokens \
                or sample.prefill_s < first.prefill_s:
            self._first, first = sample, sample  # the first probe, or a restarted vLLM
        tokens = sample.computed_tokens - first.computed_tokens
        seconds = sample.prefill_s - first.prefill_s
        if tokens >= MIN_TOKENS and seconds > 0:
            self.costs = replace(EngineCosts(), prefill_s_per_token=seconds / tokens,
                                 prefill_measured=True)
        elif first is sample:
            self.costs = EngineCosts()
        return self.costs
