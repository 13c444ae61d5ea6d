"""The Llama-family decoder (Qwen3, Llama 3, Qwen2), written once over the ``Ops`` backend."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from engine.model_config import ModelConfig
from engine.weights import CheckpointReader
from kernels.ops import Array, Ops


@dataclass(frozen=True)
class ForwardBatch:
    """One step's inputs on the device; sequence ``b`` owns token rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (contracts: kernels/reference.py).

    ``logits_indices`` are the token rows whose next-token logits are wanted, in output order.
    ``is_decode``: every sequence has exactly one new token (the decode attention kernel applies).
    ``max_query_len`` / ``max_context_len``: the most new tokens / context tokens (cached
    prefix + new) of one sequence, when the host knows them (they size the attention library's
    graphs; None: unknown).
    """

    token_ids: Array
    positions: Array
    slot_mapping: Array
    block_tables: Array
    cu_seqlens_q: Array
    context_lens: Array
    logits_indices: Array
    is_decode: bool
    max_query_len: int | None = None
    max_context_len: int | None = None


@dataclass
class LayerWeights:
    """One decoder layer; q/k/v and gate/up are merged so each is one GEMM."""

    input_norm: Array
    qkv: Array
    qkv_bias: Array | None
    q_norm: Array | None
    k_norm: Array | None
    o: Array
    o_bias: Array | None
    post_norm: Array
    gate_up: Array
    gate_up_bias: Array | None
    down: Array
    down_bias: Array | None


class DecoderModel:
    """Embedding, ``num_layers`` x (attention + SwiGLU MLP), pre-RMSNorm, final norm, lm head."""

    def __init__(
        self,
        config: ModelConfig,
        ops: Ops,
        embed: Array,
        layers: list[LayerWeights],
        final_norm: Array,
        lm_head: Array,
        cos_sin_cache: Array,
    ) -> None:
        self.config = config
        self.ops = ops
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.cos_sin_cache = cos_sin_cache
        self.scale = config.head_dim**-0.5

    @classmethod
    def load(
        cls, config: ModelConfig, reader: CheckpointReader, ops: Ops, cos_sin_cache: Array
    ) -> DecoderModel:
        """Read HF-named tensors (``model.layers.{i}.self_attn.q_proj.weight``...) to the device."""
        try:
            model = cls._load(config, reader, ops, cos_sin_cache)
        except BaseException:
            ops.weights_loaded()
            with contextlib.suppress(Exception):  # the load's own error is the one to see
                ops.weights_ready()  # no copy outlives the failed load
            raise
        ops.weights_loaded()  # the bytes move in the background until ops.weights_ready()
        return model

    @classmethod
    def _load(
        cls, config: ModelConfig, reader: CheckpointReader, ops: Ops, cos_sin_cache: Array
    ) -> DecoderModel:

        def get(name: str) -> Array:
            return ops.weight_from_host(*reader.read(name))

        def maybe(name: str) -> Array | None:
            return get(name) if name in reader else None

        def merged(prefix: str, parts: tuple[str, ...], suffix: str, present: bool) -> Array | None:
            if not present:
                return None
            return ops.stacked_weight_from_host([reader.read(f"{prefix}{p}{suffix}")
                                                 for p in parts])

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv = (".q_proj", ".k_proj", ".v_proj")
            layers.append(LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                qkv=merged(p + "self_attn", qkv, ".weight", True),
                qkv_bias=merged(p + "self_attn", qkv, ".bias", config.qkv_bias),
                q_norm=get(p + "self_attn.q_norm.weight") if config.qk_norm else None,
                k_norm=get(p + "self_attn.k_norm.weight") if config.qk_norm else None,
                o=get(p + "self_attn.o_proj.weight"),
                o_bias=get(p + "self_attn.o_proj.bias") if config.o_bias else None,
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=merged(p + "mlp", (".gate_proj", ".up_proj"), ".weight", True),
                gate_up_bias=merged(p + "mlp", (".gate_proj", ".up_proj"), ".bias",
                                    config.mlp_bias),
                down=get(p + "mlp.down_proj.weight"),
                down_bias=get(p + "mlp.down_proj.bias") if config.mlp_bias else None,
            ))
        embed = get("model.embed_tokens.weight")
        if embed.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(f"embed_tokens has shape {embed.shape}, config says "
                             f"{(config.vocab_size, config.hidden_size)}")
        lm_head = embed if config.tie_word_embeddings else maybe("lm_head.weight")
        if lm_head is None:
            raise ValueError("checkpoint lacks lm_head.weight and tie_word_embeddings is false")
        return cls(config, ops, embed, layers, get("model.norm.weight"), lm_head, cos_sin_cache)

    def forward(self, batch: ForwardBatch, kv_cache: Array) -> Array:
        """Run one step, writing this step's K/V into ``kv_cache``; float32 logits
        ``[len(logits_indices), vocab_size]``."""
        ops, cfg = self.ops, self.config
        num_tokens = batch.token_ids.shape[0]
        q_size = cfg.num_heads * cfg.head_dim
        hidden = ops.embedding(batch.token_ids, self.embed)
        residual = None
        for layer_index, w in enumerate(self.layers):
            x, residual = ops.rms_norm(hidden, w.input_norm, cfg.rms_norm_eps, residual)
            if residual is None:
                residual = hidden
            qkv = ops.linear(x, w.qkv, w.qkv_bias)
            q = ops.qkv_prepare(qkv, cfg.num_heads, cfg.num_kv_heads, w.q_norm, w.k_norm,
                                cfg.rms_norm_eps, batch.positions, self.cos_sin_cache, kv_cache,
                                layer_index, batch.slot_mapping)
            if batch.is_decode:
                attn = ops.paged_attention_decode(q, kv_cache, layer_index, batch.block_tables,
                                                  batch.context_lens, self.scale)
            else:
                attn = ops.paged_attention_prefill(q, kv_cache, layer_index, batch.block_tables,
                                                   batch.cu_seqlens_q, batch.context_lens,
                                                   self.scale, batch.max_query_len,
                                                   batch.max_context_len)
            hidden = ops.linear(attn.reshape(num_tokens, q_size), w.o, w.o_bias)
            x, residual = ops.rms_norm(hidden, w.post_norm, cfg.rms_norm_eps, residual)
            hidden = ops.linear(ops.silu_and_mul(ops.linear(x, w.gate_up, w.gate_up_bias)),
                                w.down, w.down_bias)
        last = batch.logits_indices
        x, _ = ops.rms_norm(hidden[last], self.final_norm, cfg.rms_norm_eps, residual[last])
        return ops.linear(x, self.lm_head).astype(ops.xp.float32)
