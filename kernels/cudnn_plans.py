"""The built cuDNN graphs of one handle: kept in memory (bounded), loaded from the disk cache
(``kernels/plan_cache.py``) when a start before built them, else built, timed and stored; the
shapes cuDNN refuses are remembered with the reason (the caller's kernel serves them)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kernels.build_log import CUDNN_GRAPH, CUDNN_LOAD, BuildLog
from kernels.plan_cache import PlanCache

log = logging.getLogger("kernels.cudnn_attention")

MAX_GRAPHS = 256  # built graphs kept (each holds a plan, no device memory of its own)


@dataclass
class Plan:
    """A built graph and the workspace it needs."""

    graph: Any
    workspace_bytes: int


class CudnnPlans:
    """Plans by key. ``get`` is the one way in: memory, then disk, then a build."""

    def __init__(self, cudnn, handle, builds: BuildLog, plan_cache: PlanCache) -> None:
        import cupy as cp

        self.cudnn, self._handle = cudnn, handle
        self.builds, self.plan_cache = builds, plan_cache
        self._plans: dict[tuple, Plan | None] = {}
        self.refusals: dict[tuple, str] = {}
        device = cp.cuda.Device()
        # what a serialized plan depends on besides its key (the cache never mixes setups)
        self._setup = (cudnn.__version__, int(cudnn.backend_version()),
                       cp.cuda.runtime.getDeviceProperties(device.id)["name"],
                       device.compute_capability, cp.cuda.runtime.driverGetVersion())

    @property
    def num_graphs(self) -> int:
        return sum(plan is not None for plan in self._plans.values())

    def get(self, key: tuple, build: Callable[[], Plan]) -> Plan | None:
        """The plan of ``key``, or None where cuDNN refuses it (remembered)."""
        if key in self._plans:
            return self._plans[key]
        name = PlanCache.name(key, self._setup)
        plan = self._load(name, key)
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
        if len(self._plans) >= MAX_GRAPHS:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = plan
        return plan

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
                graph = self.cudnn.pygraph(handle=self._handle)
                graph.deserialize(self._handle, blob)
                return Plan(graph, int(graph.get_workspace_size()))
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
