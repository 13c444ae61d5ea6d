"""The built cuDNN graphs of one handle: kept in memory (bounded), loaded from the disk cache
(``kernels/plan_cache.py``) when a start before built them, else built, timed and stored; the
shapes cuDNN refuses are remembered with the reason (the caller's kernel serves them).

Once the build log is sealed (the engine is ready), a shape with no graph is not built in a
request's path: it goes to the background builder (``kernels/plan_builder.py``) and ``get``
answers None, so the caller's kernel serves it until the graph comes back and is loaded. The
engine loads the graphs that came back while no request waits for its step thread (the device
runs a step the host waits for anyway, or the engine is idle: ``load_built``), so the next
request of the shape finds it in memory; ``get`` loads one in line only when no such moment
came since."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kernels.build_log import CUDNN_BACKGROUND, CUDNN_GRAPH, CUDNN_LOAD, BuildLog
from kernels.plan_builder import Built, PlanBuilder
from kernels.plan_cache import PlanCache
from kernels.plan_shapes import PlanShapes

log = logging.getLogger("kernels.cudnn_attention")

MAX_GRAPHS = 256  # built graphs kept (each holds a plan, no device memory of its own)
# The most a start spends loading the graphs earlier starts used (4-14 ms each): 2 s is ~200.
PRELOAD_BUDGET_S = 2.0


@dataclass
class Plan:
    """A built graph and the workspace it needs."""

    graph: Any
    workspace_bytes: int

    @classmethod
    def of(cls, graph) -> Plan:
        """A built (or deserialized) graph with the workspace it asks for."""
        return cls(graph, int(graph.get_workspace_size()))


class CudnnPlans:
    """Plans by key. ``get`` is the one way in: memory, then disk, then a build."""

    def __init__(self, cudnn, handle, builds: BuildLog, plan_cache: PlanCache,
                 background: PlanBuilder | None = None) -> None:
        import cupy as cp

        self.cudnn, self._handle = cudnn, handle
        self.builds, self.plan_cache, self.background = builds, plan_cache, background
        self._plans: dict[tuple, Plan | None] = {}
        self._building: dict[str, tuple] = {}  # keys handed to the background builder, by name
        self.refusals: dict[tuple, str] = {}
        self.shapes: PlanShapes | None = None  # set by ``preload``: the keys this scope used
        device = cp.cuda.Device()
        # what a serialized plan depends on besides its key (the cache never mixes setups)
        self._setup = (cudnn.__version__, int(cudnn.backend_version()),
                       cp.cuda.runtime.getDeviceProperties(device.id)["name"],
                       device.compute_capability, cp.cuda.runtime.driverGetVersion())

    @property
    def num_graphs(self) -> int:
        return sum(plan is not None for plan in self._plans.values())

    def get(self, key: tuple, build: Callable[[], Plan]) -> Plan | None:
        """The plan of ``key``, or None where cuDNN refuses it (remembered) or, after the seal,
        while the background builder builds it (not remembered: asked again next time)."""
        if key in self._plans:
            return self._plans[key]
        name = PlanCache.name(key, self._setup)
        background = self.background if self.builds.sealed else None
        if background is not None and background.knows(name):
            return self._from_background(name, key)
        plan = self._load(name, key)
        if plan is None and background is not None and background.submit(name, key):
            if len(self._building) >= MAX_GRAPHS:  # names whose result never came (dropped)
                self._building.pop(next(iter(self._building)))
            self._building[name] = key
            log.debug("cuDNN graph %s is not built: our kernel serves it while the builder "
                      "process builds it", key[:5])
            return None
        if plan is None:
            try:
                with self.builds.building(CUDNN_GRAPH, key[:5]):
                    plan = build()
            except Exception as exc:  # cuDNN refuses the shape (or this backend lacks a feature)
                self.refusals[key] = f"{type(exc).__name__}: {exc}"
                log.warning("cuDNN SDPA refuses %s, our kernel serves it: %s", key, exc)
                plan = None
            else:
                self._store(name, plan)
        return self._remember(key, plan)

    def _remember(self, key: tuple, plan: Plan | None) -> Plan | None:
        if len(self._plans) >= MAX_GRAPHS:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = plan
        if plan is not None and self.shapes is not None:
            self.shapes.add(key)  # the next start of this scope loads it before ready
        return plan

    def preload(self, scope: tuple, budget_s: float = PRELOAD_BUDGET_S) -> int:
        """Before the seal: load from the disk cache every graph an earlier start of ``scope``
        (the engine's model and arena) used, oldest first, for at most ``budget_s``; from now on
        the shapes this process uses are remembered for the next start. How many were loaded."""
        if not self.plan_cache.enabled:
            return 0
        self.shapes = PlanShapes(self.plan_cache.directory, PlanCache.name(self._setup, scope))
        deadline = time.perf_counter() + budget_s
        loaded = 0
        for key in self.shapes.load():
            if time.perf_counter() >= deadline:
                log.info("cuDNN: %d graphs preloaded in %.1f s; the rest load when first used",
                         loaded, budget_s)
                break
            if key in self._plans:
                continue
            plan = self._load(PlanCache.name(key, self._setup), key)
            if plan is not None:
                self._remember(key, plan)
                loaded += 1
        return loaded

    def load_built(self, nobody_waits: Callable[[], bool]) -> int:
        """While ``nobody_waits()`` (no request waits for this thread): load the graphs the
        background builder has sent back, oldest first (a few ms each, in this thread: cuDNN
        holds the GIL). A load after which nobody waits yet is counted as hidden
        (``BuildLog.record_hidden``), one that outlasts the moment as a first-use build. How
        many were taken."""
        background = self.background
        if background is None or not self._building:
            return 0
        taken = 0
        for name in background.finished():
            key = self._building.get(name)
            if key is None:
                continue  # not ours to load (``get`` takes it)
            if not nobody_waits():
                break
            self._from_background(name, key, nobody_waits)
            taken += 1
        return taken

    def _from_background(self, name: str, key: tuple,
                         nobody_waits: Callable[[], bool] | None = None) -> Plan | None:
        """The builder's graph for ``key`` once it is back (loaded, and kept on disk), its
        refusal (remembered), or None while it is still being built. ``nobody_waits``: the load
        runs while no request waits (see ``load_built``); without it a request waits for it."""
        outcome = self.background.take(name)
        if outcome is None:
            return None
        self._building.pop(name, None)
        if not isinstance(outcome, Built):
            self.refusals[key] = outcome.reason
            log.warning("cuDNN SDPA refuses %s, our kernel serves it: %s", key, outcome.reason)
            return self._remember(key, None)
        try:
            start = time.perf_counter()
            plan = self._deserialize(outcome.blob)
            seconds = time.perf_counter() - start
            if nobody_waits is not None and nobody_waits():
                self.builds.record_hidden(CUDNN_BACKGROUND, key[:5], seconds)
            else:
                self.builds.record(CUDNN_BACKGROUND, key[:5], seconds)
        except Exception as exc:  # cannot load what the child built: never ask it again
            self.refusals[key] = f"the builder's graph does not load: {exc}"
            log.warning("cuDNN: the builder's graph for %s does not load (%s); our kernel "
                        "serves it", key[:5], exc)
            return self._remember(key, None)
        self.plan_cache.put(name, outcome.blob)  # nothing when the cache is off
        return self._remember(key, plan)

    def _deserialize(self, blob: bytes) -> Plan:
        graph = self.cudnn.pygraph(handle=self._handle)
        graph.deserialize(self._handle, blob)
        return Plan.of(graph)

    def refuse(self, key: tuple, reason: str) -> None:
        """cuDNN refused running ``key``'s plan: never use it again."""
        self.refusals[key] = reason
        self._plans[key] = None

    def _load(self, name: str, key: tuple) -> Plan | None:
        """The plan of ``key`` from the disk cache, or None (absent, or cuDNN cannot load it:
        then it is built again and the entry overwritten)."""
        blob = self.plan_cache.get(name)
        if blob is None:
            return None
        try:
            with self.builds.building(CUDNN_LOAD, key[:5]):
                return self._deserialize(blob)
        except Exception as exc:  # another frontend's format, a stale kernel: build it again
            log.warning("cuDNN plan cache: cannot load %s (%s); building it", key[:5], exc)
            self.plan_cache.count("unloadable")
            return None

    def _store(self, name: str, plan: Plan) -> None:
        if not self.plan_cache.enabled:
            return
        try:
            blob = plan.graph.serialize(as_bytes=True)
        except Exception as exc:  # a graph this frontend cannot serialize: built every start
            self.plan_cache.count("unserializable")
            log.debug("cuDNN plan cache: cannot serialize: %s", exc)
            return
        self.plan_cache.put(name, blob)
