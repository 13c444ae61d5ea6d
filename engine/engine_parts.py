"""EngineParts: one engine's parts built from its config, each from the ones before it.

The model folder gives the model config and the tokenizer; the device gives the ops; both give the
runner, whose KV arena is sized from what is left of the device (``kv_capacity.py``); the block
manager accounts that arena's blocks; the store bridge (``--kv-offload``, else a null bridge) is
registered over it; the scheduler takes requests through both. ``LLMEngine`` drives the result.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.block_manager import BlockManager
from engine.config import (
    MIN_PREFILL_GRAPH_TOKENS,
    EngineConfig,
    check_dtype,
    cuda_index,
    resolve_device,
)
from engine.grammar import GrammarCompiler
from engine.kv_cache import kv_block_bytes
from engine.kv_capacity import kv_budget_bytes, max_len_limit, plan_capacity
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.prefill_order import PrefillOrder
from engine.scheduler import Scheduler
from engine.tokenizer import Tokenizer
from engine.weights import weights_identity
from kernels import make_ops
from offload.bridge import StoreBridge
from offload.factory import make_store_bridge
from offload.null_bridge import NullStore
from offload.vocab import ModelIdentity


@dataclass(frozen=True)
class EngineParts:
    """What one model on one device is made of; ``build`` makes them in order."""

    device: str  # "cpu" or "cuda"
    cuda_index: int | None  # cuda:N: made current by each step too
    model_config: ModelConfig
    tokenizer: Tokenizer
    grammars: GrammarCompiler  # structured outputs
    model_identity: ModelIdentity  # what the block keys' namespace names
    model_name: str  # --served-model-name, else the folder's name
    engine_id: str  # what the store knows this engine by (a router maps it)
    runner: ModelRunner  # the model, its KV arena and its graphs
    max_model_len: int
    block_manager: BlockManager
    offload: StoreBridge  # the store, or a null bridge: one interface either way
    scheduler: Scheduler

    @classmethod
    def build(cls, config: EngineConfig) -> EngineParts:
        """The parts ``config`` asks for; FileNotFoundError without the model folder,
        ValueError for a dtype or size the device cannot serve."""
        model_dir = Path(config.model_dir)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model folder {config.model_dir!r} does not exist")
        device = resolve_device(config.device)
        device_index = cuda_index(config.device)
        mc = ModelConfig.load(model_dir)
        tokenizer = Tokenizer(config.tokenizer_dir or model_dir, mc.eos_token_ids)
        if config.chat_template is not None:  # --chat-template: replaces the folder's template
            tokenizer.chat_template = config.chat_template
        grammars = GrammarCompiler(tokenizer, mc.vocab_size)
        ops = make_ops(device)
        check_dtype(config.dtype, ops.kv_dtype, device)
        limit = max_len_limit(config, mc.max_position_embeddings)
        model_identity = ModelIdentity(
            architecture=mc.architecture, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim, kv_dtype=ops.kv_dtype, block_size=config.block_size,
            weights_id=weights_identity(model_dir),
        )
        model_name = config.served_model_name or model_dir.resolve().name
        engine_id = f"{model_name}-{os.getpid()}-{secrets.token_hex(6)}"  # one per engine
        runner = ModelRunner(mc, str(model_dir), ops, config.block_size, limit,
                             tokenizer.eos_token_ids)
        block_bytes = kv_block_bytes(mc.num_layers, config.block_size, mc.num_kv_heads,
                                     mc.head_dim, np.dtype(ops.kv_dtype).itemsize)
        budget = kv_budget_bytes(config, device) if config.num_kv_blocks is None else 0
        num_kv_blocks, max_model_len = plan_capacity(config, limit, block_bytes, budget)
        runner.allocate_kv_cache(device, num_kv_blocks)
        if ops.supports_graphs and not config.enforce_eager:
            # no bucket larger than a step can be (each costs a capture before ready)
            graph_tokens = max(MIN_PREFILL_GRAPH_TOKENS, min(config.max_prefill_graph_tokens,
                                                             config.max_num_batched_tokens))
            runner.enable_decode_graphs(config.max_num_seqs,
                                        -(-max_model_len // config.block_size), graph_tokens)
        block_manager = BlockManager(num_kv_blocks, config.block_size,
                                     config.enable_prefix_caching, config.debug_hash_bits)
        offload: StoreBridge = NullStore()
        if config.kv_offload:
            offload = make_store_bridge(
                config.kv_store_socket, runner.kv_cache.layout(), engine_id, block_manager,
                block_bytes, config.kv_offload_policy, device,
                always_restore=config.kv_offload_restore == "always",
                share_hbm=config.kv_offload_share_hbm)
        scheduler = Scheduler(
            block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            PrefillOrder(config.prefill_order, config.max_prefill_wait_steps,
                         config.latency_chunk_tokens), offload.restores)
        return cls(device=device, cuda_index=device_index, model_config=mc,
                   tokenizer=tokenizer, grammars=grammars,
                   model_identity=model_identity, model_name=model_name, engine_id=engine_id,
                   runner=runner, max_model_len=max_model_len, block_manager=block_manager,
                   offload=offload, scheduler=scheduler)
