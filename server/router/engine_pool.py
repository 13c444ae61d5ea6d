"""EnginePool: the router's engines, their readiness and load, probed on ``GET /load``.

Each engine is probed every ``probe_interval_s`` (an engine that failed too: it comes back when
it answers again). A probe that fails, or a request the engine cannot be reached for, marks it
DOWN at once, so the next requests skip it. Its load, as the router counts it, is what the
engine reported at the last probe (engine requests in flight) less the router's own requests
to it in flight at that moment, plus the router's requests to it in flight now: exact for the
router's own traffic, as fresh as the last probe for anyone else's. Its queue, for the cost
model, is the prompt tokens the router sent it and has not yet seen answered (its first byte),
and its costs are what its last /load measured (prefill rate, restore bandwidth by tier).

Engines are of two kinds: kvengine (``GET /load``) and vLLM, which has no /load: its load and
prefill rate come from its ``GET /metrics`` (``VllmMeter``; the load counted as kvengine's
reported load is, restores priced at the GPU priors), and what it holds in HBM
comes from its KV events (``residency``, kept by a ``KVEventFeed``). With ``kind="auto"`` an
engine whose /load answers 404 is taken for vLLM from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import httpx

from server.engine_protocol import LOAD_PATH
from server.router.engine_residency import EngineResidency
from server.router.policy import Candidate, EngineCosts
from server.router.prompt_chain import KVIdentity
from server.router.vllm_meter import VllmMeter, parse_metrics

logger = logging.getLogger("kvengine.router")

VLLM_METRICS_PATH = "/metrics"
ENGINE_KINDS = ("auto", "kvengine", "vllm")


class EngineKind(str, enum.Enum):
    KVENGINE = "kvengine"
    VLLM = "vllm"


class EngineState(str, enum.Enum):
    UNKNOWN = "unknown"  # not probed yet
    READY = "ready"
    DOWN = "down"  # unreachable, or its step loop died


@dataclass
class UpstreamEngine:
    """One engine behind the router."""

    url: str  # base URL, no trailing slash
    kind: EngineKind | None = None  # None: not known yet (auto, before its first probe)
    residency: EngineResidency | None = None  # vLLM: its GPU blocks, from its KV events
    meter: VllmMeter = field(default_factory=VllmMeter)  # vLLM: load and prefill rate
    state: EngineState = EngineState.UNKNOWN
    engine_id: str | None = None  # its registration's engine_id at the kvstore daemon
    identity: KVIdentity | None = None  # None: it runs without --kv-offload (no blocks to find)
    reported_load: int = 0  # its requests in flight, at the last probe
    in_flight: int = 0  # the router's requests to it in flight now
    in_flight_at_probe: int = 0
    queued_s: float = 0.0  # seconds of work the router sent it and has not seen answered
    costs: EngineCosts = field(default_factory=EngineCosts)  # as its last /load measured them

    @property
    def load(self) -> int:
        return self.in_flight + max(0, self.reported_load - self.in_flight_at_probe)

    def candidate(self, num_hbm: int = 0) -> Candidate:
        return Candidate(self.url, self.load, num_hbm, self.queued_s, self.costs)


class EnginePool:
    """The engines by URL; probing runs as one task on the router's event loop."""

    def __init__(self, urls: list[str], client: httpx.AsyncClient,
                 probe_headers: Mapping[str, str] | None = None, probe_interval_s: float = 1.0,
                 probe_timeout_s: float = 1.0, kind: str = "auto",
                 on_probed: Callable[[], Awaitable[None]] | None = None,
                 residencies: Mapping[str, EngineResidency] | None = None) -> None:
        """``kind``: one of ENGINE_KINDS; ``on_probed``: awaited after each round of probes
        (the router's own upkeep); ``residencies``: by URL, the vLLM engines whose KV events
        keep them (those engines are vLLM's whatever ``kind`` says)."""
        if not urls:
            raise ValueError("at least one engine URL is needed")
        if kind not in ENGINE_KINDS:
            raise ValueError(f"engine kind must be one of {ENGINE_KINDS}, got {kind!r}")
        known = None if kind == "auto" else EngineKind(kind)
        residencies = {url.rstrip("/"): r for url, r in (residencies or {}).items()}
        self.engines = {}
        for url in (u.rstrip("/") for u in urls):
            residency = residencies.get(url)
            kind_of = EngineKind.VLLM if residency is not None else known
            self.engines[url] = UpstreamEngine(url, kind_of, residency)
        if len(self.engines) != len(urls):
            raise ValueError("an engine URL is given twice")
        if residencies.keys() - self.engines.keys():
            raise ValueError("a residency is given for an engine that is not in the pool")
        self.on_probed = on_probed
        self._client = client
        self._headers = dict(probe_headers or {})
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._task: asyncio.Task | None = None

    # ---- what routing reads ----------------------------------------------------------------
    def ready(self) -> list[UpstreamEngine]:
        """The engines to route to now, in the order given."""
        return [e for e in self.engines.values() if e.state is EngineState.READY]

    def by_engine_id(self) -> dict[str, UpstreamEngine]:
        """Ready engines by the engine_id they registered with at the daemon."""
        return {e.engine_id: e for e in self.ready() if e.engine_id is not None}

    def kind(self) -> EngineKind | None:
        """The kind of the ready engines; None when there are none or they are of both kinds
        (then only load can route)."""
        kinds = {e.kind for e in self.ready()}
        return kinds.pop() if len(kinds) == 1 else None

    def identity(self) -> KVIdentity | None:
        """The block-key identity of the ready engines (the first that reports one)."""
        for engine in self.ready():
            if engine.identity is not None:
                return engine.identity
        return None

    def mark_down(self, engine: UpstreamEngine, reason: str) -> None:
        """The engine could not be reached for a request: skip it until a probe succeeds."""
        if engine.state is not EngineState.DOWN:
            logger.warning("engine %s is down (%s); skipped until it answers a probe",
                           engine.url, reason)
        engine.state = EngineState.DOWN

    # ---- probing ---------------------------------------------------------------------------
    def start(self) -> None:
        """Probe every engine now and then every ``probe_interval_s`` (on the running loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._probe_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def probe_all(self) -> None:
        """Probe every engine once, concurrently (each bounded by ``probe_timeout_s``)."""
        await asyncio.gather(*(self._probe(e) for e in self.engines.values()))

    async def _probe_forever(self) -> None:
        while True:
            await self.probe_all()
            if self.on_probed is not None:
                try:
                    await self.on_probed()
                except Exception:  # upkeep must not end the probes
                    logger.exception("router upkeep after the probes failed")
            await asyncio.sleep(self.probe_interval_s)

    async def _probe(self, engine: UpstreamEngine) -> None:
        if engine.kind is EngineKind.VLLM:
            await self._probe_vllm(engine)
            return
        try:
            response = await self._client.get(engine.url + LOAD_PATH, headers=self._headers,
                                              timeout=self.probe_timeout_s)
            if response.status_code == 404 and engine.kind is None:
                logger.info("engine %s has no %s: taken for vLLM (load from its %s)",
                            engine.url, LOAD_PATH, VLLM_METRICS_PATH)
                engine.kind = EngineKind.VLLM
                await self._probe_vllm(engine)
                return
            if response.status_code != 200:
                raise ValueError(f"GET {LOAD_PATH} answered {response.status_code}: "
                                 f"{response.text[:200]}")
            report = response.json()
            identity = None
            if report.get("kv_offload"):
                identity = KVIdentity.from_report(report["model_identity"],
                                                  int(report["block_size"]))
            alive = bool(report["alive"])
            load = int(report["num_in_flight"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self.mark_down(engine, f"probe failed: {type(exc).__name__}: {exc}")
            return
        engine.kind = EngineKind.KVENGINE
        engine.engine_id = str(report["engine_id"])
        engine.identity = identity
        engine.costs = EngineCosts.from_report(report.get("costs"))
        engine.reported_load, engine.in_flight_at_probe = load, engine.in_flight
        if not alive:
            self.mark_down(engine, "its step loop is not running")
            return
        if engine.state is not EngineState.READY:
            logger.info("engine %s is ready (engine_id %s)", engine.url, engine.engine_id)
        engine.state = EngineState.READY

    async def _probe_vllm(self, engine: UpstreamEngine) -> None:
        """A vLLM engine: alive while its /metrics answers with its scheduler's gauges."""
        try:
            response = await self._client.get(engine.url + VLLM_METRICS_PATH,
                                              headers=self._headers, timeout=self.probe_timeout_s)
            if response.status_code != 200:
                raise ValueError(f"GET {VLLM_METRICS_PATH} answered {response.status_code}")
            sample = parse_metrics(response.content)
        except (httpx.HTTPError, ValueError) as exc:
            self.mark_down(engine, f"probe failed: {type(exc).__name__}: {exc}")
            return
        engine.costs = engine.meter.update(sample)
        engine.reported_load, engine.in_flight_at_probe = sample.load, engine.in_flight
        if engine.state is not EngineState.READY:
            logger.info("engine %s (vLLM) is ready", engine.url)
        engine.state = EngineState.READY

