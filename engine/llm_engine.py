"""The request API and the step loop: requests in (any thread), one step at a time, outputs out.

``add_request``, ``abort_request``, ``has_unfinished_requests`` and ``stats`` are thread-safe: they
only touch an inbox and counters under a lock. ``step`` runs on one thread (the serving loop); it
moves the inbox into the scheduler, so the scheduler, block manager and runner are single-threaded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from engine.config import EngineConfig, use_cuda_device
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_parts import EngineParts
from engine.engine_stats import EngineCounters
from engine.grammar import GrammarMatcher
from engine.kv_cache import KVCache
from engine.logprobs import TokenLogprobs
from engine.outputs import FinishReason, RequestOutput, empty_tier_counts, prefix_source
from engine.prompt_ids import checked_prompt
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.step_timing import StepTiming
from offload.vocab import Namespace

log = logging.getLogger("engine")

# A step with nothing to run but restores waits at most this long for one of their replies (then
# steps again): no busy loop. A request or an abort that arrives meanwhile ends the wait at once.
IDLE_RESTORE_WAIT_S = 0.005
# With a store: while the device runs a step, requests that arrive are taken at once (their
# lookups sent, their restores started where the reply is in), for this share of the previous
# step's time after the forward was queued. Taken at the next step's start instead, a request
# waits there for its lookup's reply, and one not answered within that step's bounded wait
# loses a whole step: a first turn arriving 30 ms after another waited about 10 ms more with
# offload in two H200 runs of three, and in neither of two with the watch (one request a run,
# the `queued` phase of benchmarks/results/multiturn-agent-tools-h200-120s-http-{timed,watch}-*
# -s16-*: thin evidence, but the mechanism is plain). A request
# arriving at an idle engine still waits the round trip (about 1 ms there). Not up to the
# step's end: the device's end is noticed between waits, and a step that ends before the share
# is over is noticed at most ARRIVAL_POLL_S late.
ARRIVAL_WATCH_STEP_SHARE = 0.8
ARRIVAL_POLL_S = 0.0002


class LLMEngine:
    """One model on one device with its KV arena, block manager, scheduler and sampler."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parts = EngineParts.build(config)
        self.device, self._cuda_index = parts.device, parts.cuda_index
        self.model_config, self.tokenizer = parts.model_config, parts.tokenizer
        self.grammars = parts.grammars
        self.model_identity, self.model_name = parts.model_identity, parts.model_name
        self.engine_id = parts.engine_id
        self.runner, self.max_model_len = parts.runner, parts.max_model_len
        self.block_manager, self.scheduler = parts.block_manager, parts.scheduler
        self.offload = parts.offload
        # Requests without a seed draw theirs from here: --seed makes a whole run repeatable.
        self._seeds = np.random.default_rng(config.seed)
        self._offload_pending = False  # the last step's store work is still to do
        # A mid-prefill chunk samples nothing, so its step returns before the device finished it
        # and the next step's time includes the rest: only steps between syncs are timed.
        self._last_step_synced = True
        # The last step the host waited for the device in: the arrival watch's measure (a step
        # of mid-prompt chunks only returns once its launches are queued).
        self.last_waited_step: StepTiming | None = None
        self._eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self._lock = threading.Lock()
        self._inbox: list[Sequence] = []
        self._arrived = threading.Event()  # set by add_request: the step thread may take it
        self._abort_ids: list[str] = []
        self._live_ids: set[str] = set()
        self._counters = EngineCounters(self.block_manager, self.scheduler, self.offload)
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
        ids, token_bytes = checked_prompt(prompt_token_ids, self.model_config.vocab_size,
                                          self.max_model_len)
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
        if self.block_manager.enable_prefix_caching:
            # Its blocks' hash chain, made here on the caller's thread (while the step thread
            # waits on the device), not by the step thread's first prefix match, ahead of the
            # request's store lookup: ~0.2 ms for a 7k-token prompt on an H200 host.
            self.block_manager.update_hashes(seq)
        with self._lock:
            if request_id in self._live_ids:
                raise ValueError(f"request id {request_id!r} is already in the engine")
            self._live_ids.add(request_id)
            self._inbox.append(seq)
        self._arrived.set()

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
            return self._counters.latest(num_queued=len(self._inbox))

    # -- the step loop (one thread) ---------------------------------------------------------

    def use_idle_time(self) -> None:
        """No request is left: load the attention graphs the background builder finished
        meanwhile, until a request arrives (``Ops.load_built_plans``), so a later request does
        not load one in its path. Returns at once when nothing waits to be loaded."""
        self._use_device()
        self.runner.ops.load_built_plans(lambda: not self.has_unfinished_requests())

    def _use_device(self) -> None:
        """Make the engine's GPU current on this thread (CUDA's current device is per thread)."""
        if self._cuda_index is not None:
            use_cuda_device(self._cuda_index)

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
        self._use_device()
        self.flush_offload()
        t_flushed = time.perf_counter()
        with self._lock:
            abort_ids, self._abort_ids = self._abort_ids, []
        self._take_inbox()
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
            result = self.runner.execute(batch, while_device_runs=self._during_step)
            elapsed = time.perf_counter() - t_scheduled
            for seq, entries in result.prompt_logprobs:
                seq.prompt_logprobs.extend(entries)
            self.scheduler.advance(batch)
            # reading sampled tokens or prompt logprobs waited for the step's device work
            synced = bool(result.sampled or result.prompt_logprobs)
            # before finished sequences free blocks; a mid-prompt chunk's blocks go to the
            # store only once its kernels have written them
            saves = not synced and self.offload.store_state is not None  # else no event
            self.offload.save_computed(
                batch.seqs, self.runner.ops.work_done_marker() if saves else None)
            if synced and self._last_step_synced:  # else device time leaks across steps
                self.offload.observe_step(batch.num_tokens - len(batch.seqs), elapsed)
            self._last_step_synced = synced
            outputs.extend(self._append_token(seq, token, logprobs)
                           for seq, token, logprobs in result.sampled)
        elif self.scheduler.num_loading:  # only restores: no busy loop, no arrival kept waiting
            self.scheduler.restores.wait_for_progress(IDLE_RESTORE_WAIT_S, self._nothing_new)
        self._offload_pending = True  # see flush_offload
        self.last_step = StepTiming(
            flush_s=t_flushed - t_start, add_s=t_added - t_flushed,
            schedule_s=t_scheduled - t_added, execute_s=elapsed,
            total_s=time.perf_counter() - t_start, num_seqs=len(batch.seqs),
            num_tokens=batch.num_tokens, num_loading=self.scheduler.num_loading)
        if batch and self._last_step_synced:
            self.last_waited_step = self.last_step
        finished_ids = [out.request_id for out in outputs if out.finished]
        with self._lock:
            self._live_ids.difference_update(finished_ids)
            self._counters.end_step(len(finished_ids))
        return outputs

    def _during_step(self, device_done: Callable[[], bool], host_waits: bool = True) -> None:
        """While the device runs the step: requests that arrived meanwhile join the scheduler
        (their store lookups go out now), and restores whose lookups are answered start their
        loads, so they cross the bus during this step rather than after the next schedule. In a
        step the host waits for anyway (``host_waits``), finished attention graphs are loaded
        while the device is busy (``Ops.load_built_plans``), and with a store requests arriving
        later are taken as they come (for ``ARRIVAL_WATCH_STEP_SHARE`` of the last waited-for
        step's time); a step of mid-prompt chunks returns at once, so the host queues the next
        chunk while the device computes this one (watching there cost a 4,864-token cold
        prefill 1.17x its time on an H200)."""
        last = self.last_waited_step
        watch_until = time.perf_counter() + ARRIVAL_WATCH_STEP_SHARE * (
            last.execute_s if last is not None else 0.0)  # from the forward's queueing on
        self._arrived.clear()
        self._take_inbox()
        self.scheduler.start_restores_during_step(device_done)
        if host_waits:  # attention graphs built since: loaded now, not in a request's path
            self.runner.ops.load_built_plans(lambda: not device_done())
        if self.offload.store_state is None or not host_waits:
            return  # no lookups to send early, or a wait the step would not have made
        while not device_done():
            left = watch_until - time.perf_counter()
            if left <= 0:
                break
            if self._arrived.wait(min(ARRIVAL_POLL_S, left)):
                self._arrived.clear()
                self._take_inbox()
                self.scheduler.start_restores_during_step(device_done)

    def _nothing_new(self) -> bool:
        """No request or abort arrived since the step took them (any thread may add them)."""
        return not self._inbox and not self._abort_ids

    def _take_inbox(self) -> None:
        """Hand the requests added since to the scheduler (which sends their lookups)."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for seq in inbox:
            seq.taken_time = time.perf_counter()
            self.scheduler.add(seq)

    def _append_token(self, seq: Sequence, token_id: int,
                      logprobs: TokenLogprobs | None) -> RequestOutput:
        seq.token_ids.append(token_id)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        self._counters.count_token()
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
            self._observe_first_token(seq)
        params = seq.params
        reason = None
        if (token_id in self._eos_token_ids and not params.ignore_eos
                or params.stop_token_ids and token_id in params.stop_token_ids):
            reason = FinishReason.STOP  # the token stays in token_ids; its text only on request
            if token_id not in self._eos_token_ids or params.ignore_eos:
                seq.stop_reason = token_id  # a stop token, not eos (vLLM's stop_reason)
            if params.include_stop_str_in_output:
                seq.detokenizer.update(seq.output_token_ids, check_stop=False)
        elif seq.detokenizer.update(seq.output_token_ids,
                                    check_stop=seq.num_output_tokens > params.min_tokens):
            reason = FinishReason.STOP
            seq.stop_reason = seq.detokenizer.matched_stop
        elif seq.grammar is not None and seq.grammar.advance(token_id):
            reason = FinishReason.STOP  # the grammar is complete: nothing more may follow
            if seq.grammar.error:  # or broken: the answer is cut, and says so (vLLM's "error")
                reason = FinishReason.ERROR
                # its first line: the rest dumps the whole grammar (100 KB for a large schema)
                log.warning("request %s: its structured output's grammar failed, the answer is "
                            "cut (finish_reason error): %.300s", seq.request_id,
                            seq.grammar.error.splitlines()[0])
        elif (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens
              or seq.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return self._output(seq)

    def _observe_first_token(self, seq: Sequence) -> None:
        """Tell the store bridge where this sequence's time to its first token went."""
        if seq.first_scheduled_time is None or seq.first_token_time is None:
            return
        kind = prefix_source(seq.cached_tokens_by_tier)
        self.offload.observe_first_token(kind, seq.first_scheduled_time - seq.arrival_time,
                                         seq.first_token_time - seq.first_scheduled_time)

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
            new_logprobs=new_logprobs,
            prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None
            else None, arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time, first_token_time=seq.first_token_time,
            output_time=time.perf_counter(), taken_time=seq.taken_time,
            restore_times=seq.restore_times,
        )

    def warm_up(self) -> int:
        """Capture the CUDA graphs one request's short prefill and decode steps replay (the
        cuDNN graphs they use built with them), so no request pays for it; how many were
        captured (0 without graphs: CPU, --enforce-eager)."""
        captured = self.runner.warm_up()
        self.runner.ops.builds.seal()  # from here on a build is a cost some request waits for
        return captured

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
