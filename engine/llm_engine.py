"""The request API and the step loop: requests in (any thread), one step at a time, outputs out.

``add_request``, ``abort_request``, ``has_unfinished_requests`` and ``stats`` are thread-safe: they
only touch an inbox and counters under a lock. ``step`` runs on one thread (the serving loop); it
moves the inbox into the scheduler, so the scheduler, block manager and runner are single-threaded.
"""

from __future__ import annotations

import operator
import os
import struct
import threading
import time
from pathlib import Path

import numpy as np

from engine.block_manager import BlockManager
from engine.config import EngineConfig, check_dtype, cuda_index, resolve_device, use_cuda_device
from engine.detokenizer import IncrementalDetokenizer
from engine.grammar import GrammarCompiler, GrammarMatcher
from engine.kv_cache import KVCache, kv_block_bytes
from engine.kv_capacity import kv_budget_bytes, max_len_limit, plan_capacity
from engine.logprobs import TokenLogprobs
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput, empty_tier_counts
from engine.prefill_order import PrefillOrder
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.step_timing import StepTiming
from engine.tokenizer import Tokenizer
from engine.weights import weights_identity
from kernels import make_ops
from offload.bridge import StoreBridge
from offload.factory import make_store_bridge
from offload.null_bridge import NullStore
from offload.vocab import ModelIdentity, Namespace


class LLMEngine:
    """One model on one device with its KV arena, block manager, scheduler and sampler."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = Path(config.model_dir)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model folder {config.model_dir!r} does not exist")
        self.device = resolve_device(config.device)
        self._cuda_index = cuda_index(config.device)  # cuda:N: made current by each step too
        self.model_config = mc = ModelConfig.load(model_dir)
        self.tokenizer = Tokenizer(config.tokenizer_dir or model_dir, mc.eos_token_ids)
        if config.chat_template is not None:  # --chat-template: replaces the folder's template
            self.tokenizer.chat_template = config.chat_template
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size)  # structured outputs
        ops = make_ops(self.device)
        check_dtype(config.dtype, ops.kv_dtype, self.device)
        # Requests without a seed draw theirs from here: --seed makes a whole run repeatable.
        self._seeds = np.random.default_rng(config.seed)
        limit = max_len_limit(config, mc.max_position_embeddings)
        self.model_identity = ModelIdentity(
            architecture=mc.architecture, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim, kv_dtype=ops.kv_dtype, block_size=config.block_size,
            weights_id=weights_identity(model_dir),
        )
        self.model_name = config.served_model_name or model_dir.resolve().name
        # What the store knows this engine by (its registration's engine_id; a router maps it).
        self.engine_id = f"{self.model_name}-{os.getpid()}-{id(self):x}"
        self.runner = ModelRunner(mc, str(model_dir), ops, config.block_size, limit,
                                  self.tokenizer.eos_token_ids)
        block_bytes = kv_block_bytes(mc.num_layers, config.block_size, mc.num_kv_heads,
                                     mc.head_dim, np.dtype(ops.kv_dtype).itemsize)
        budget = kv_budget_bytes(config, self.device) if config.num_kv_blocks is None else 0
        num_kv_blocks, self.max_model_len = plan_capacity(config, limit, block_bytes, budget)
        self.runner.allocate_kv_cache(self.device, num_kv_blocks)
        if ops.supports_graphs and not config.enforce_eager:
            self.runner.enable_decode_graphs(config.max_num_seqs,
                                             -(-self.max_model_len // config.block_size))
        self.block_manager = BlockManager(num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching, config.debug_hash_bits)
        # The store (--kv-offload), or a null bridge: the scheduler and the step loop call one
        # interface either way.
        self.offload: StoreBridge = NullStore()
        if config.kv_offload:
            self.offload = make_store_bridge(
                config.kv_store_socket, self.kv_cache.layout(), self.engine_id, self.block_manager,
                block_bytes, config.kv_offload_policy, self.device,
                always_restore=config.kv_offload_restore == "always",
                share_hbm=config.kv_offload_share_hbm)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            PrefillOrder(config.prefill_order, config.max_prefill_wait_steps,
                         config.latency_chunk_tokens), self.offload.restores)
        self._offload_pending = False  # the last step's store work is still to do
        # A mid-prefill chunk samples nothing, so its step returns before the device finished it
        # and the next step's time includes the rest: only steps between syncs are timed.
        self._last_step_synced = True
        self._eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self._lock = threading.Lock()
        self._inbox: list[Sequence] = []
        self._abort_ids: list[str] = []
        self._live_ids: set[str] = set()
        self._num_generation_tokens = 0
        self._num_finished = 0
        self._num_steps = 0
        self._stats = self._collect_stats()
        self.last_step: StepTiming | None = None  # where the last step's time went (step thread)
        self._closed = False

    # -- request API (any thread) -----------------------------------------------------------

    def namespace(self, cache_salt: str = "") -> Namespace:
        """The block-key namespace of this model for a tenant."""
        return Namespace(model=self.model_identity, tenant_salt=cache_salt)

    def compile_grammar(self, params: SamplingParams,
                        prompt_token_ids: list[int]) -> GrammarMatcher | None:
        """``params.structured_outputs`` compiled for this prompt (None without one) for
        ``add_request``; slow (seconds for a large schema), thread-safe, GIL released: a server
        calls it off its loop, once for all choices. ValueError if it does not compile."""
        return self.grammars.matcher(params.structured_outputs, prompt_token_ids)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        cache_salt: str = "", grammar: GrammarMatcher | None = None,
    ) -> None:
        """Queue a request; ValueError for a bad id, an empty or too long prompt, bad params.
        ``grammar``: ``compile_grammar``'s for these params and prompt (else compiled here)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if not isinstance(cache_salt, str):
            raise ValueError("cache_salt must be a string")
        if params.max_token_id() >= self.model_config.vocab_size:
            raise ValueError(f"token id {params.max_token_id()} in stop_token_ids or logit_bias "
                             f"is out of range: the vocabulary has "
                             f"{self.model_config.vocab_size} tokens")
        ids, token_bytes = self._check_prompt(prompt_token_ids)
        seed = params.seed
        if seed is None:
            with self._lock:
                seed = int(self._seeds.integers(1 << 63))
        seq = Sequence(request_id=request_id, prompt_token_ids=ids, params=params,
                       namespace_digest=self.namespace(cache_salt).digest,
                       generator=np.random.default_rng(seed),
                       detokenizer=IncrementalDetokenizer(
                           self.tokenizer, params.stop, params.skip_special_tokens,
                           params.include_stop_str_in_output),
                       token_bytes=token_bytes, arrival_time=time.perf_counter(),
                       # or ValueError; the prompt may have ended a reasoning already
                       grammar=self.grammars.request_matcher(params.structured_outputs, ids,
                                                             grammar))
        with self._lock:
            if request_id in self._live_ids:
                raise ValueError(f"request id {request_id!r} is already in the engine")
            self._live_ids.add(request_id)
            self._inbox.append(seq)

    def _check_prompt(self, prompt_token_ids: list[int]) -> tuple[list[int], bytes]:
        """The prompt as a fresh list of ints plus its int32-LE bytes (what block hashes are
        made of); ValueError unless it is 1..max_model_len integers in [0, vocab_size)."""
        vocab_size = self.model_config.vocab_size
        if not isinstance(prompt_token_ids, (list, tuple)):
            try:
                prompt_token_ids = list(prompt_token_ids)
            except TypeError:
                raise ValueError("prompt_token_ids must be a list of integers") from None
        # One C-level pass converts and checks every id (an integer that fits int32).
        try:
            token_bytes: bytes | None = struct.pack(f"<{len(prompt_token_ids)}i",
                                                    *prompt_token_ids)
        except (struct.error, TypeError, ValueError, OverflowError):
            try:  # which error to report: not integers, or out of range (vocab ids fit int32)
                for t in prompt_token_ids:
                    operator.index(t)
            except TypeError:
                raise ValueError("prompt_token_ids must be a list of integers") from None
            token_bytes = None
        num_tokens = len(prompt_token_ids)
        if not num_tokens:
            raise ValueError("the prompt is empty")
        if num_tokens > self.max_model_len:
            raise ValueError(f"the prompt has {num_tokens} tokens, more than max_model_len "
                             f"{self.max_model_len}")
        tokens = np.frombuffer(token_bytes or b"", dtype="<i4")
        if token_bytes is None or int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        return tokens.tolist(), token_bytes

    def abort_request(self, request_id: str) -> None:
        """Ask for the request to end with reason "abort" at the next step; unknown ids are
        ignored (the request may have just finished)."""
        with self._lock:
            if request_id in self._live_ids and request_id not in self._abort_ids:
                self._abort_ids.append(request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._live_ids)

    def stats(self) -> dict:
        """Counters as of the last step (queued requests included in ``num_waiting``)."""
        with self._lock:
            stats = dict(self._stats)
            stats["num_waiting"] += len(self._inbox)
        if stats["kv_offload"] is not None:  # the store's health now, not as of the last step
            stats["kv_offload"] = {**stats["kv_offload"], "store_state": self.offload.store_state}
        return stats

    # -- the step loop (one thread) ---------------------------------------------------------

    def flush_offload(self) -> None:
        """The store work the last step left for after its outputs (``--kv-offload``): send its
        saves, publish evictions and resident blocks. ``step`` runs it first if nobody did; a
        serving loop calls it right after handing the outputs on, so no token waits for it."""
        if self._offload_pending:
            self._offload_pending = False
            self.offload.after_step()

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; outputs of requests that got a token or ended."""
        t_start = time.perf_counter()
        if self._cuda_index is not None:  # CUDA's current device is per thread
            use_cuda_device(self._cuda_index)
        self.flush_offload()
        t_flushed = time.perf_counter()
        with self._lock:
            inbox, self._inbox = self._inbox, []
            abort_ids, self._abort_ids = self._abort_ids, []
        for seq in inbox:
            self.scheduler.add(seq)
        outputs = []
        for request_id in abort_ids:
            seq = self.scheduler.abort(request_id)
            if seq is not None:
                outputs.append(self._output(seq))
        t_added = time.perf_counter()
        batch = self.scheduler.schedule()
        t_scheduled = time.perf_counter()
        elapsed = 0.0
        if batch:
            for seq in batch.seqs:
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = t_scheduled
            sampled = self.runner.execute(batch)
            elapsed = time.perf_counter() - t_scheduled
            self.scheduler.advance(batch)
            synced = bool(sampled)  # reading sampled tokens waited for the step's device work
            self.offload.save_computed(batch.seqs)  # before finished sequences free blocks
            if synced and self._last_step_synced:  # else device time leaks across steps
                self.offload.observe_step(batch.num_tokens - len(batch.seqs), elapsed)
            self._last_step_synced = synced
            outputs.extend(self._append_token(seq, token, logprobs)
                           for seq, token, logprobs in sampled)
        elif self.scheduler.num_loading:
            self.scheduler.restores.wait_for_progress(0.005)  # only restores: no busy loop
        self._offload_pending = True  # see flush_offload
        self.last_step = StepTiming(
            flush_s=t_flushed - t_start, add_s=t_added - t_flushed,
            schedule_s=t_scheduled - t_added, execute_s=elapsed,
            total_s=time.perf_counter() - t_start, num_seqs=len(batch.seqs),
            num_tokens=batch.num_tokens, num_loading=self.scheduler.num_loading)
        with self._lock:
            for out in outputs:
                if out.finished:
                    self._live_ids.discard(out.request_id)
                    self._num_finished += 1
            self._num_steps += 1
            self._stats = self._collect_stats()
        return outputs

    def _append_token(self, seq: Sequence, token_id: int,
                      logprobs: TokenLogprobs | None) -> RequestOutput:
        seq.token_ids.append(token_id)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        self._num_generation_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        params = seq.params
        reason = None
        if (token_id in self._eos_token_ids and not params.ignore_eos
                or params.stop_token_ids and token_id in params.stop_token_ids):
            reason = "stop"  # the token stays in token_ids; its text only on request
            if token_id not in self._eos_token_ids or params.ignore_eos:
                seq.stop_reason = token_id  # a stop token, not eos (vLLM's stop_reason)
            if params.include_stop_str_in_output:
                seq.detokenizer.update(seq.output_token_ids, check_stop=False)
        elif seq.detokenizer.update(seq.output_token_ids,
                                    check_stop=seq.num_output_tokens > params.min_tokens):
            reason = "stop"
            seq.stop_reason = seq.detokenizer.matched_stop
        elif seq.grammar is not None and seq.grammar.advance(token_id):
            reason = "stop"  # the grammar is complete (or broken): nothing more may follow
        elif (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens
              or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return self._output(seq)

    def _output(self, seq: Sequence) -> RequestOutput:
        finished = seq.is_finished
        output_ids = seq.output_token_ids
        text = seq.detokenizer.visible_text(finished)
        new_ids = output_ids[seq.num_emitted_tokens :]
        logprobs = seq.output_logprobs if seq.params.logprobs is not None else None
        new_logprobs = logprobs[seq.num_emitted_tokens :] if logprobs is not None else None
        new_text = text[seq.num_emitted_chars :]
        seq.num_emitted_tokens = len(output_ids)
        seq.num_emitted_chars = len(text)
        num_cached = seq.num_cached_tokens or 0
        by_tier = empty_tier_counts()
        by_tier.update(seq.cached_tokens_by_tier)
        # The prompt list is shared, not copied per step: the engine only ever reads it.
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            token_ids=output_ids, text=text, finished=finished, finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason if finished else None,
            num_cached_tokens=num_cached, cached_tokens_by_tier=by_tier,
            new_token_ids=new_ids, new_text=new_text, logprobs=logprobs,
            new_logprobs=new_logprobs, arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time, first_token_time=seq.first_token_time,
            output_time=time.perf_counter(),
        )

    def _collect_stats(self) -> dict:
        bm, sched = self.block_manager, self.scheduler
        hit_tokens = empty_tier_counts()
        hit_tokens.update(self.offload.restores.hit_tokens_by_tier)
        hit_tokens["hbm"] += sched.num_prefix_hit_tokens  # own prefix cache (peers': hbm_peer)
        return {
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting) - sched.num_loading,
            "num_loading": sched.num_loading,
            "num_kv_blocks": bm.num_blocks,
            "num_blocks_in_use": bm.num_used_blocks,
            "num_blocks_cached": bm.num_cached_blocks,
            "block_size": bm.block_size,
            "prefix_cache_queries": sched.num_prefix_query_tokens,
            "prefix_cache_hit_tokens": hit_tokens,
            "prefix_cache_evictions": bm.num_evictions,
            "prefix_cache_collisions": bm.num_collisions,
            "prompt_tokens_total": sched.num_prompt_tokens,
            "generation_tokens_total": self._num_generation_tokens,
            "num_preemptions": sched.num_preemptions,
            "prefix_cache_hits": sched.num_prefix_hit_tokens,  # this engine's own cache only
            "num_requests_finished": self._num_finished,
            "num_steps": self._num_steps,
            "kv_offload": self.offload.stats(),
        }

    def warm_up(self) -> int:
        """Capture the CUDA graphs one request's short prefill and decode steps replay (the
        cuDNN graphs they use built with them), so no request pays for it; how many were
        captured (0 without graphs: CPU, --enforce-eager)."""
        return self.runner.warm_up()

    def reset_prefix_cache(self) -> int:
        """Drop every HBM-cached block no request uses; call between steps (step thread)."""
        num_evicted = self.block_manager.reset_prefix_cache()
        self.offload.after_step()  # publish the evictions now
        return num_evicted

    # -- lifetime ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding: prompt token ids must be below this."""
        return self.model_config.vocab_size

    @property
    def kv_cache(self) -> KVCache:
        """The KV arena (shared-memory name, dtype, ``layout()``) for the offload bridge."""
        return self.runner.kv_cache

    def close(self) -> None:
        """Free the KV arena; the engine is unusable afterwards. Idempotent."""
        if not self._closed:
            self._closed = True
            self.flush_offload()
            self.offload.close()
            self.runner.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
