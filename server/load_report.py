"""GET /load: an engine's load and its identity in the store, cheap enough for a router to poll.

`kvengine router` sends a request to the engine holding its prefix, else to the least loaded
one. It learns here how loaded an engine is (requests admitted and not finished, running and
waiting as of the last step), under which ``engine_id`` the engine registered with the kvstore
daemon (the daemon's ``locate`` answers per registration; this is how the router tells which
registration is which engine), and the model identity the engine's block keys are salted with,
so the router computes a prompt's block chain exactly as the engine does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from server.async_engine import AsyncEngine
from server.engine_protocol import (
    LOAD_PATH,
    EngineSettingsView,
    kv_store_state,
    offload_stats,
)


class RoutedEngine(Protocol):
    """What /load reads of the engine beyond ServedEngine: its store identity."""

    engine_id: str

    @property
    def config(self) -> EngineSettingsView: ...

    def namespace(self, cache_salt: str = "") -> Any:
        """The block-key namespace (kvstore.keys.Namespace) for a tenant; ``.model`` is the
        model identity (a dataclass)."""
        ...


class EngineLoad(BaseModel):
    """The body of GET /load."""

    engine_id: str
    model: str
    alive: bool
    num_in_flight: int  # engine requests admitted and not finished (now)
    num_running: int  # as of the last step
    num_waiting: int
    num_loading: int
    num_requests_finished: int
    kv_offload: bool
    kv_store: str | None  # "ok", "hung" or "down" with --kv-offload
    block_size: int
    model_identity: dict[str, Any]  # kvstore.keys.ModelIdentity's fields
    # What the router's cost model prices a prompt with, as the engine measured it (its restore
    # policy's estimates): prefill_tokens_per_s (prefill_measured: False while it is the
    # prior), kv_bytes_per_token, restore_bytes_per_s by tier (restore_measured: the tiers
    # whose rate was timed, not the prior). None without --kv-offload.
    costs: dict[str, Any] | None = None


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "fp8": 1}


def kv_bytes_per_token(identity: dict[str, Any]) -> int:
    """K and V of one token over every layer, from a ModelIdentity's fields (0 if unknown)."""
    itemsize = _DTYPE_BYTES.get(str(identity.get("kv_dtype")), 0)
    return 2 * itemsize * int(identity.get("num_layers", 0)) * \
        int(identity.get("num_kv_heads", 0)) * int(identity.get("head_dim", 0))


def routing_costs(stats: dict[str, Any], bytes_per_token: int) -> dict[str, Any] | None:
    """``EngineLoad.costs`` from an engine's stats snapshot; None without offload."""
    offload = offload_stats(stats)
    policy = offload.get("restore_policy") if offload is not None else None
    if not isinstance(policy, dict) or bytes_per_token <= 0:
        return None
    return {"prefill_tokens_per_s": float(policy.get("prefill_tokens_per_s", 0.0)),
            "prefill_measured": bool(policy.get("prefill_measured", False)),
            "kv_bytes_per_token": bytes_per_token,
            "restore_bytes_per_s": dict(policy.get("bandwidth_bytes_per_s", {})),
            "restore_measured": list(policy.get("bandwidth_measured", []))}


def install_load_route(app: FastAPI, async_engine: AsyncEngine, engine: RoutedEngine,
                       model_name: str) -> None:
    """Add GET /load to ``app`` (behind the app's API-key check like every route)."""
    identity = dataclasses.asdict(engine.namespace("").model)
    bytes_per_token = kv_bytes_per_token(identity)
    fixed = {"engine_id": engine.engine_id, "model": model_name,
             "kv_offload": bool(engine.config.kv_offload),
             "block_size": int(engine.config.block_size), "model_identity": identity}

    # Not in the OpenAPI schema: it is the router's, not part of the OpenAI API.
    @app.get(LOAD_PATH, response_model=EngineLoad, include_in_schema=False)
    async def load() -> JSONResponse:
        stats = async_engine.stats()
        return JSONResponse({
            **fixed,
            "alive": async_engine.alive,
            "num_in_flight": async_engine.num_in_flight,
            "num_running": int(stats.get("num_running", 0)),
            "num_waiting": int(stats.get("num_waiting", 0)),
            "num_loading": int(stats.get("num_loading", 0)),
            "num_requests_finished": int(stats.get("num_requests_finished", 0)),
            "kv_store": kv_store_state(stats),
            "costs": routing_costs(stats, bytes_per_token),
        })
