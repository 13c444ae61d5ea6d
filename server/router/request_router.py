"""RequestRouter: a request body in, the engine to send it to out.

For ``--routing kv`` the prompt is rendered and tokenized exactly as the engines do it (the same
PromptBuilder over the same tokenizer and chat template, the tenant salt from the API key and
``cache_salt`` as ``server.auth.tenant_salt`` makes it), its block chain built as the engine
keys it (``prompt_chain.py``), and the kvstore daemon asked in one ``locate`` where its
leading blocks are; the daemon's registrations map to engines by the engine_id each engine
reports on /load. A body the router cannot read is routed by load: the engine it goes to answers
it (its 400 passes through unchanged). The router never refuses a request the engines would take.

In front of vLLM engines the prompt is rendered and tokenized the same way (vLLM serves the same
model folder's tokenizer and chat template), its tenant is its ``cache_salt`` alone (vLLM salts
by nothing else), what each engine holds in HBM comes from its KV events (``EngineResidency``
over ``VllmKeys.event_chain``), and the daemon is asked where the connector's chain is in DRAM
and SSD (``VllmKeys.store_chain``); the cost model is the same.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection

from pydantic import ValidationError

from server.api_error import APIError
from server.auth import tenant_salt
from server.chat_tools import template_inputs
from server.prompt_builder import PromptBuilder
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.router.engine_pool import EngineKind, EnginePool, UpstreamEngine
from server.router.kv_locator import KVLocator
from server.router.metrics import RouterMetrics
from server.router.policy import Placement, Route, RoutingPolicy
from server.router.prompt_chain import PromptChain
from server.router.routed_prefixes import RoutedPrefixes
from server.router.vllm_keys import VllmKeys

CHAT, COMPLETION = "chat", "completion"
# One line per kv-routed request at DEBUG: what the policy saw and chose (``ROUTE_LOG_PREFIX``
# then JSON), for a benchmark or an operator to replay a decision with ``policy.estimate``.
route_log = logging.getLogger("kvengine.router.routes")
ROUTE_LOG_PREFIX = "route "


class RequestRouter:
    """Routes generation requests (``route``) and everything else (``least_loaded``)."""

    def __init__(self, pool: EnginePool, policy: RoutingPolicy, metrics: RouterMetrics,
                 locator: KVLocator | None = None, prompts: PromptBuilder | None = None,
                 vllm_keys: VllmKeys | None = None) -> None:
        if policy.uses_kv and (locator is None or prompts is None):
            raise ValueError("kv routing needs the daemon (locator) and the prompt builder")
        self.pool = pool
        self.policy = policy
        self.metrics = metrics
        self.locator = locator
        self.prompts = prompts
        self.routed = RoutedPrefixes()
        self.vllm_keys = vllm_keys or VllmKeys()

    async def upkeep(self) -> None:
        """After each round of probes: with vLLM engines, read the connector's identity from
        the daemon (bounded; a daemon that does not answer leaves the last one)."""
        if self.locator is None or not any(e.kind is EngineKind.VLLM
                                           for e in self.pool.engines.values()):
            return
        engines = await self.locator.engines()
        if engines is not None:
            self.vllm_keys.learn(engines)

    async def route(self, kind: str, body: bytes,
                    key_salt: str) -> tuple[UpstreamEngine, Route] | None:
        """The engine for a generation request (``kind``: CHAT or COMPLETION) and the route
        (its ``compute_tokens`` join the engine's queue while the request is sent), counted by
        reason; None when no engine is ready."""
        start = time.perf_counter()
        ready = self.pool.ready()
        if not ready:
            return None
        route = await self._choose(ready, kind, body, key_salt)  # ties: the key's own turns
        identity = self.pool.identity()
        block_size = identity.block_size if identity is not None else \
            self.vllm_keys.block_size or 0
        self.metrics.routed(route, block_size, time.perf_counter() - start)
        return self.pool.engines[route.url], route

    def least_loaded(self, exclude: Collection[str] = ()) -> UpstreamEngine | None:
        """A ready engine not in ``exclude`` with the fewest requests in flight, or None."""
        ready = [e for e in self.pool.ready() if e.url not in exclude]
        if not ready:
            return None
        return self.pool.engines[self.policy.least_loaded([e.candidate() for e in ready]).url]

    async def _choose(self, ready: list[UpstreamEngine], kind: str, body: bytes,
                      key_salt: str) -> Route:
        if not self.policy.uses_kv:
            return self.policy.choose([e.candidate() for e in ready], None, key_salt)
        engine_kind = self.pool.kind()
        if engine_kind is EngineKind.VLLM:
            return await self._choose_vllm(ready, kind, body, key_salt)
        if engine_kind is None:  # engines of both kinds: their blocks cannot be compared
            return self.policy.choose([e.candidate() for e in ready], None, key_salt)
        identity = self.pool.identity()
        if identity is None:  # no engine runs with --kv-offload: there is no store to ask
            return self.policy.choose([e.candidate() for e in ready], None, key_salt)
        start = time.perf_counter()
        prompt = await self._prompt(kind, body, key_salt)
        if prompt is None:  # the engine will refuse it: no prompt to place
            return self.policy.choose([e.candidate() for e in ready], Placement(0, 1), key_salt)
        token_ids, salt = prompt
        chain = PromptChain.of(identity, token_ids, salt)
        prompt_s = time.perf_counter() - start
        self.metrics.prompted(prompt_s)
        if not len(chain):
            return self.policy.choose([e.candidate() for e in ready],
                                      Placement(len(token_ids), identity.block_size), key_salt)
        assert self.locator is not None
        start = time.perf_counter()
        reply = await self.locator.locate(chain)
        locate_s = time.perf_counter() - start
        self.metrics.located(locate_s)
        if reply is None:
            return self.policy.choose([e.candidate() for e in ready], None, key_salt)
        held: dict[str, int] = {}  # engine URL -> leading blocks in its HBM
        by_id = self.pool.by_engine_id()
        for registration in reply.engines:
            engine = by_id.get(registration.engine_id)
            if engine is not None and engine.identity == identity:
                held[engine.url] = max(held.get(engine.url, 0), registration.num_hbm)
        hashes = chain.hashes
        candidates = [e.candidate(max(held.get(e.url, 0), self.routed.held(e.url, hashes)))
                      for e in ready]
        placement = Placement(len(token_ids), identity.block_size, reply.num_dram,
                              reply.num_stored)
        route = self.policy.choose(candidates, placement, key_salt)
        self.routed.mark(route.url, hashes)  # a burst sees it before the daemon does
        if route_log.isEnabledFor(logging.DEBUG):
            route_log.debug("%s%s", ROUTE_LOG_PREFIX, _decision(
                candidates, placement, route, {"prompt": prompt_s, "locate": locate_s}))
        return route

    async def _choose_vllm(self, ready: list[UpstreamEngine], kind: str, body: bytes,
                           key_salt: str) -> Route:
        """``_choose`` for vLLM engines: HBM from their KV events, DRAM and SSD from the
        daemon in the connector's keys."""
        keys = self.vllm_keys
        block_size = keys.block_size or next(
            (e.residency.block_size for e in ready
             if e.residency is not None and e.residency.block_size), None)
        start = time.perf_counter()
        prompt = await self._prompt(kind, body, key_salt, vllm=True)
        if prompt is None or block_size is None:  # unreadable, or nothing known of vLLM's keys
            return self.policy.choose([e.candidate() for e in ready], Placement(0, 1), key_salt)
        token_ids, salt = prompt
        hashes = keys.event_chain(token_ids, salt, block_size)
        store = keys.store_chain(token_ids, salt) if block_size == keys.block_size else None
        self.metrics.prompted(time.perf_counter() - start)
        placement = Placement(len(token_ids), block_size)
        if store is not None and len(store) and self.locator is not None:
            start = time.perf_counter()
            reply = await self.locator.locate(store)
            self.metrics.located(time.perf_counter() - start)
            if reply is not None:
                placement = Placement(len(token_ids), block_size, reply.num_dram,
                                      reply.num_stored)
        candidates = [e.candidate(max(e.residency.held(hashes) if e.residency else 0,
                                      self.routed.held(e.url, hashes))) for e in ready]
        route = self.policy.choose(candidates, placement, key_salt)
        self.routed.mark(route.url, hashes)
        if route_log.isEnabledFor(logging.DEBUG):
            route_log.debug("%s%s", ROUTE_LOG_PREFIX, _decision(candidates, placement, route))
        return route

    async def _prompt(self, kind: str, body: bytes, key_salt: str,
                      vllm: bool = False) -> tuple[list[int], str] | None:
        """The first prompt's token ids and its tenant salt, as the engine will see them (for
        vLLM: its ``cache_salt``, "" for none); None for a body the engine will refuse (or
        that the router cannot read)."""
        assert self.prompts is not None
        try:
            if kind == CHAT:
                chat = ChatCompletionRequest.model_validate_json(body)
                # as the engine renders it: tools and tool calls' arguments included
                messages, kwargs = template_inputs(
                    [m.template_fields() for m in chat.messages], chat.chat_template_kwargs,
                    chat.tools)
                salt = (chat.cache_salt or "") if vllm else tenant_salt(key_salt,
                                                                         chat.cache_salt)
                return await self.prompts.chat(messages, chat.add_generation_prompt, salt,
                                               kwargs), salt
            completion = CompletionRequest.model_validate_json(body)
            salt = (completion.cache_salt or "") if vllm else tenant_salt(key_salt,
                                                                          completion.cache_salt)
            prompt = completion.prompt
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # a list of prompts: they all go to one engine
            (token_ids,) = await self.prompts.completion(prompt, salt)
            return token_ids, salt
        except (ValidationError, APIError, ValueError, TypeError, IndexError):
            return None


def _decision(candidates: list, placement: Placement, route: Route,
              stages_s: dict[str, float] | None = None) -> str:
    """A routing decision as one JSON line (see ``route_log``); ``stages_s``: how long its
    stages took (the prompt's tokens and chain, the daemon's locate)."""
    return json.dumps({
        "t": time.time(), "chosen": route.url, "reason": route.reason.value,
        "stages_ms": {k: round(v * 1e3, 3) for k, v in (stages_s or {}).items()},
        "estimate_s": route.estimate_s, "compute_tokens": route.compute_tokens,
        "tokens": placement.num_tokens, "dram": placement.num_dram,
        "stored": placement.num_stored,
        "candidates": [{"name": c.url, "load": c.load, "hbm": c.num_hbm,
                        "queued_s": round(c.queued_s, 6),
                        "prefill_s_per_token": c.costs.prefill_s_per_token,
                        "measured": c.costs.prefill_measured} for c in candidates]})
