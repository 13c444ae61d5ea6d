"""The daemon's /metrics holds only declared families (issue 30 item 4): every ``kvstore_*`` name
and type on a real daemon's scrape is in ``kvstore/daemon/metrics.py``'s table (or is the
request latency histogram, prometheus_client's), and every declared family is there from the
first scrape, so dashboards never see a series appear late or change type."""

from __future__ import annotations

import re

import httpx
from prometheus_client import Histogram

from kvstore.daemon.latency import RequestLatency
from kvstore.daemon.metrics import FAMILIES

TYPE_LINE = re.compile(r"^# TYPE (\S+) (\S+)$", re.M)


def _declared() -> dict[str, str]:
    out = {(f.name + "_total" if f.kind == "counter" else f.name): f.kind for f in FAMILIES}
    out["kvstore_request_duration_seconds"] = "histogram"
    out["kvstore_request_duration_seconds_created"] = "gauge"  # prometheus_client's own
    return out


def test_every_family_on_metrics_is_declared_with_its_type(make_daemon, tmp_path) -> None:
    daemon = make_daemon(http=True, ssd_dir=tmp_path / "ssd", ssd_size="16MiB")
    with daemon.client() as c:
        c.put(b"k", b"v" * 1000)
        c.get(b"k")
    text = httpx.get(daemon.http_url + "/metrics", timeout=10).text
    exported = {name: kind for name, kind in TYPE_LINE.findall(text)
                if name.startswith("kvstore_")}
    assert exported == _declared()
    assert re.search(r'^kvstore_tier_events_total\{event="writes",tier="ssd"\} ', text, re.M)
    assert re.search(r'^kvstore_ssd_state\{state="ok"\} 1\.0$', text, re.M)


def test_the_latency_histogram_is_prometheus_clients() -> None:
    latency = RequestLatency()
    assert isinstance(latency.histogram, Histogram)
    latency.observe("lookup", 0.0003)
    latency.observe("put", 1.0)  # not a timed verb
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for metric in latency.histogram.collect() for s in metric.samples}
    assert samples[("kvstore_request_duration_seconds_count", (("verb", "lookup"),))] == 1
    assert ("kvstore_request_duration_seconds_count", (("verb", "put"),)) not in samples
