"""build_router: the parts of `kvengine router` made from its options, joined into its app."""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx
from fastapi import FastAPI

from server.http_front_args import api_keys, metrics_key
from server.prompt_builder import PromptBuilder
from server.prompt_tokenizer import PromptTokenizer
from server.router.app import RouterSettings, build_router_app
from server.router.args import engine_names, events_by_url
from server.router.engine_pool import EnginePool
from server.router.engine_residency import EngineResidency
from server.router.kv_event_feed import KVEventFeed
from server.router.kv_locator import KVLocator
from server.router.metrics import RouterMetrics
from server.router.policy import RoutingPolicy
from server.router.proxy import RouterProxy
from server.router.request_router import RequestRouter
from server.router.vllm_keys import VllmKeys
from server.tokenize_pool import TokenizePool


def build_router(args: argparse.Namespace, model_dir: Path,
                 tokenizer_dir: Path | None) -> FastAPI:
    """The router's app over ``args.engines``; ValueError for options that do not fit."""
    keys = api_keys(args)
    operator_key = metrics_key(args)
    if operator_key is not None and operator_key in keys:
        raise ValueError("the metrics key must differ from every API key")
    policy = RoutingPolicy(args.routing)
    prompts = _prompt_builder(args, model_dir, tokenizer_dir) if policy.uses_kv else None
    timeout = httpx.Timeout(args.upstream_timeout, connect=args.connect_timeout)
    # One pool of connections for the requests (RouterProxy sends on the transport) and the
    # probes (through a client over it); never through a proxy from the environment.
    transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(
        max_connections=args.max_upstream_connections,
        max_keepalive_connections=args.max_upstream_connections), trust_env=False)
    client = httpx.AsyncClient(transport=transport, timeout=timeout, trust_env=False)
    probe_headers = {"Authorization": f"Bearer {keys[0]}"} if keys else None
    names = engine_names(args.engines)
    events = events_by_url(args.engines, args.kv_events)
    if events and args.engine_kind == "kvengine":
        raise ValueError("--kv-events is for vLLM engines (kvengine's HBM comes from the daemon)")
    residencies = {url: EngineResidency() for url in events}
    feeds = [KVEventFeed(names[url], address.endpoint, residencies[url], address.replay_endpoint)
             for url, address in events.items()]

    async def upkeep() -> None:  # the router is made below, with the pool it routes over
        await router.upkeep()

    pool = EnginePool(list(names), client, probe_headers, args.probe_interval,
                      args.probe_timeout, args.engine_kind, upkeep, residencies)
    metrics = RouterMetrics(pool, feeds)
    locator = None
    if policy.uses_kv:
        locator = KVLocator(args.kv_store_socket, args.kv_locate_timeout_s,
                            args.kv_retry_interval)
    router = RequestRouter(pool, policy, metrics, locator, prompts, VllmKeys(model_dir))
    for feed in feeds:
        feed.start()

    async def shutdown() -> None:
        for feed in feeds:
            feed.stop()
        await client.aclose()
        if locator is not None:
            locator.close()
        if prompts is not None:
            prompts.close()

    settings = RouterSettings(api_keys=keys, metrics_key=operator_key,
                              max_request_body_bytes=args.max_request_body_bytes)
    header = {"name": names.get, "url": str, "off": lambda url: None}[args.engine_header]
    proxy = RouterProxy(transport, timeout, pool, metrics, args.first_byte_timeout, header)
    return build_router_app(router, proxy, settings, shutdown)


def _prompt_builder(args: argparse.Namespace, model_dir: Path,
                    tokenizer_dir: Path | None) -> PromptBuilder:
    """Prompts rendered and tokenized as the engines do: the engine's tokenizer and chat
    template over the same folders, the server's PromptBuilder (tenant caches, bounded pool)."""
    from engine.model_config import ModelConfig
    from engine.tokenizer import Tokenizer

    folder = tokenizer_dir or model_dir
    codec = Tokenizer(folder)
    if args.chat_template is not None:  # as LLMEngine applies --chat-template
        codec.chat_template = args.chat_template
    pool = TokenizePool()
    # The model's context bounds the prompts an engine can take (its max_model_len is at most
    # this): longer texts are not tokenized here either.
    max_len = ModelConfig.load(model_dir).max_position_embeddings
    return PromptBuilder(codec, PromptTokenizer(codec, folder, num_threads=pool.num_workers + 1),
                         max_len, pool, on_overloaded=lambda: None)
