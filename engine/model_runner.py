"""The only code that holds device arrays: weights, the KV arena, one forward + sample per step."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import DEFAULT_MAX_PREFILL_GRAPH_TOKENS
from engine.decode_graphs import DecodeGraphs
from engine.kv_arena import make_kv_cache
from engine.kv_cache import KVCache
from engine.logprobs import TokenLogprobs, token_logprobs
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderModel, ForwardBatch
from engine.models.rope import cos_sin_cache
from engine.prefill_graphs import PrefillGraphs
from engine.sampler import Sampler
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.step_inputs import pack_prefill, pack_step
from engine.weights import CheckpointReader
from kernels.ops import Array, Ops

log = logging.getLogger("engine")

# Prompt-logprob rows scored per host pass: the float64 log-softmax of a whole chunk of a large
# vocabulary (2,048 rows x 152k) would hold 2.5 GB of host memory at once.
PROMPT_LOGPROB_ROWS_PER_PASS = 256


def _done() -> bool:
    """The device check of a backend that ran the forward before returning."""
    return True


@dataclass
class StepResult:
    """What one step computed: (sequence, sampled token id, its logprobs if asked) for every
    sequence that samples, and the prompt logprobs of the chunks that owed some (entries for
    the prompt tokens after the ones the sequence already holds, in order)."""

    sampled: list[tuple[Sequence, int, TokenLogprobs | None]] = field(default_factory=list)
    prompt_logprobs: list[tuple[Sequence, list[TokenLogprobs]]] = field(default_factory=list)


class ModelRunner:
    """Loads the model onto ``ops``' device, owns the KV arena, runs scheduled batches."""

    def __init__(
        self, model_config: ModelConfig, model_dir: str, ops: Ops, block_size: int,
        max_positions: int, eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.model_config = model_config
        self.ops = ops
        self.block_size = block_size
        table = cos_sin_cache(model_config.rope, model_config.head_dim, max_positions)
        reader = CheckpointReader(model_dir)
        try:
            self.model = DecoderModel.load(model_config, reader, ops, ops.to_device(table))
        finally:
            reader.close()
        # the weights' bytes are still on their way (``Ops.weights_loaded``): the warm-up runs
        # beside them; warm_up's end, or the first step, waits for them
        self._weights_pending = True
        self.sampler = Sampler(ops, eos_token_ids)
        log.info("attention: %s", ops.attention_backend)
        self.kv_cache: KVCache | None = None  # sized after the weights: see allocate_kv_cache
        self.decode_graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None

    @property
    def attention_backend(self) -> str:
        """Which attention runs, e.g. ``prefill=cudnn decode=ours`` (for logs and /metrics)."""
        return self.ops.attention_backend

    def allocate_kv_cache(self, device: str, num_kv_blocks: int) -> None:
        """Create the arena; once, after the weights are on the device."""
        if self.kv_cache is not None:
            raise RuntimeError("the KV arena is already allocated")
        mc = self.model_config
        shape = (num_kv_blocks, mc.num_layers, 2, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_cache = make_kv_cache(device, shape, self.ops.kv_dtype)
        self.num_preloaded_plans = 0  # attention graphs the warm-up loaded for earlier starts

    def enable_decode_graphs(self, max_rows: int, max_table_width: int,
                             max_prefill_tokens: int = DEFAULT_MAX_PREFILL_GRAPH_TOKENS) -> None:
        """Replay decode steps and short prefill steps from CUDA graphs (after
        ``allocate_kv_cache``; GPU only)."""
        self.decode_graphs = DecodeGraphs(self.ops, self.model, self.kv_cache.array, max_rows,
                                          max_table_width)
        self.prefill_graphs = PrefillGraphs(self.ops, self.model, self.kv_cache.array,
                                            max_table_width, self.block_size,
                                            max_prefill_tokens)

    def warm_up(self) -> int:
        """Compile the kernels any request can reach (``Ops.warm_kernels``, the sampler's),
        capture the graphs requests replay (``warm_buckets`` of each), then seal them: no
        capture in a request's path from then on; the number captured (0 without graphs)."""
        mc = self.model_config
        # the long prefills' graphs an earlier start met after its warm-up (kernels/plan_shapes)
        self.num_preloaded_plans = self.ops.preload_attention_plans(
            (mc.num_heads, *self.kv_cache.array.shape, str(self.kv_cache.array.dtype)))
        self.ops.warm_kernels(mc.num_heads, mc.num_kv_heads, mc.head_dim, self.block_size,
                              mc.vocab_size)
        self.sampler.warm_up(mc.vocab_size)
        if self.decode_graphs is None or self.prefill_graphs is None:
            self.weights_ready()
            return 0
        before = self.decode_graphs.num_captures + self.prefill_graphs.num_captures
        for num_seqs, num_tokens in self.prefill_graphs.warm_buckets():
            self.prefill_graphs.capture(num_seqs, num_tokens)
        for rows, width in self.decode_graphs.warm_buckets():
            self.decode_graphs.capture(rows, width)
        self.prefill_graphs.seal()
        self.decode_graphs.seal()
        self.weights_ready()
        return self.decode_graphs.num_captures + self.prefill_graphs.num_captures - before

    def weights_ready(self) -> None:
        """Wait for the weights' upload (started by the load, run beside the warm-up); every
        step calls it first, and only the first one waits."""
        if self._weights_pending:
            self.ops.weights_ready()
            self._weights_pending = False

    def prepare(self, batch: ScheduledBatch) -> tuple[ForwardBatch, list[Sequence]]:
        """The step's metadata on the device (one copy). The sequences that reach their last
        token this step sample; the others are mid-prefill chunks. The logits rows are the
        samplers', then the prompt-logprob rows (``step_inputs.pack_step``)."""
        host, layout, sampling = pack_step(batch.seqs, batch.num_new_tokens, self.block_size)
        views = layout.views(self.ops.to_device(host))
        views["logits_indices"] = views["logits_indices"][: len(sampling) + layout.num_prompt_rows]
        forward_batch = ForwardBatch(is_decode=all(n == 1 for n in batch.num_new_tokens),
                                     max_query_len=max(batch.num_new_tokens),
                                     max_context_len=max(seq.num_computed_tokens + n for seq, n
                                                         in zip(batch.seqs,
                                                                batch.num_new_tokens)),
                                     **views)
        return forward_batch, sampling

    def forward(self, forward_batch: ForwardBatch) -> Array:
        """float32 logits for the batch's ``logits_indices`` rows."""
        self.weights_ready()
        return self.model.forward(forward_batch, self.kv_cache.array)

    def execute(self, batch: ScheduledBatch,
                while_device_runs: Callable[[Callable[[], bool], bool], None] | None = None
                ) -> StepResult:
        """Run the step: sample, and compute the prompt logprobs the batch's chunks owe.
        ``while_device_runs``: called once the forward is queued and before anything waits for
        it (host work that then overlaps the device's), with a check of whether the device has
        finished the forward (always True on a backend that runs synchronously) and whether
        this step will wait for it (it reads sampled tokens or prompt logprobs; a step of
        mid-prompt chunks only does not, and the host queues the next step meanwhile)."""
        self.weights_ready()
        owed = [(seq, positions) for seq, n in zip(batch.seqs, batch.num_new_tokens)
                if (positions := seq.prompt_logprob_positions(n))]
        result = StepResult()
        # eager where prompt logprobs are owed: the captured graphs keep only the sampling rows
        logits, sampling = (self._eager(batch) if owed else
                            self._replayed(batch) or self._eager(batch))
        if while_device_runs is not None:
            while_device_runs(self.ops.work_done_marker() or _done, bool(sampling or owed))
        if owed:
            result.prompt_logprobs = self._prompt_logprobs(logits[len(sampling):], owed)
            logits = logits[: len(sampling)]
        if sampling:
            result.sampled = [(seq, token_id, logprobs) for seq, (token_id, logprobs)
                              in zip(sampling, self.sampler(logits, sampling))]
        return result

    def _prompt_logprobs(self, logits: Array, owed: list[tuple[Sequence, range]]
                         ) -> list[tuple[Sequence, list[TokenLogprobs]]]:
        """Row k of ``logits`` is the k-th owed position in order; position p's row scores
        prompt token p + 1 (raw logits, as the sampled tokens' logprobs)."""
        targets: list[int] = []
        num_top: list[int] = []
        for seq, positions in owed:
            targets.extend(seq.token_ids[positions.start + 1: positions.stop + 1])
            num_top.extend([seq.params.prompt_logprobs] * len(positions))
        entries: list[TokenLogprobs] = []
        for start in range(0, len(targets), PROMPT_LOGPROB_ROWS_PER_PASS):
            end = start + PROMPT_LOGPROB_ROWS_PER_PASS
            entries.extend(token_logprobs(self.ops.to_host(logits[start:end]),
                                          targets[start:end], num_top[start:end]))
        out, start = [], 0
        for seq, positions in owed:
            out.append((seq, entries[start: start + len(positions)]))
            start += len(positions)
        return out

    def _eager(self, batch: ScheduledBatch) -> tuple[Array, list[Sequence]]:
        forward_batch, sampling = self.prepare(batch)
        return self.forward(forward_batch), sampling

    def _replayed(self, batch: ScheduledBatch) -> tuple[Array, list[Sequence]] | None:
        """A decode or short prefill step from a captured graph, or None when it must run
        eagerly."""
        graphs = self.decode_graphs
        if graphs is None:
            return None
        if any(n != 1 for n in batch.num_new_tokens):
            return self._replayed_prefill(batch)
        key = graphs.bucket(len(batch.seqs), max(len(seq.block_ids) for seq in batch.seqs))
        if key is None:
            return None
        host, _, sampling = pack_step(batch.seqs, batch.num_new_tokens, self.block_size, *key)
        logits = graphs.run(key, host)
        return logits[: len(sampling)], sampling

    def _replayed_prefill(self, batch: ScheduledBatch) -> tuple[Array, list[Sequence]] | None:
        graphs = self.prefill_graphs
        if graphs is None or any(seq.num_computed_tokens + n != seq.num_tokens
                                 for seq, n in zip(batch.seqs, batch.num_new_tokens)):
            return None  # a mid-prompt chunk samples nothing: eager
        key = graphs.bucket(len(batch.seqs), batch.num_tokens)
        if key is None:
            return None
        host, _, sampling = pack_prefill(batch.seqs, batch.num_new_tokens, self.block_size,
                                         key[1], graphs.table_width)
        return graphs.run(key, host), sampling

    def close(self) -> None:
        self.ops.close()
        if self.kv_cache is not None:
            self.kv_cache.close()
