"""The only code that holds device arrays: weights, the KV arena, one forward + sample per step."""

from __future__ import annotations

import numpy as np

from engine.kv_cache import KVCache, make_kv_cache
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderModel, ForwardBatch
from engine.models.rope import cos_sin_cache
from engine.sampler import Sampler
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.weights import CheckpointReader
from kernels.ops import Array, Ops


class ModelRunner:
    """Loads the model onto ``ops``' device, owns the KV arena, runs scheduled batches."""

    def __init__(
        self, model_config: ModelConfig, model_dir: str, ops: Ops, block_size: int,
        max_positions: int,
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
        self.sampler = Sampler(ops)
        self.kv_cache: KVCache | None = None  # sized after the weights: see allocate_kv_cache

    def allocate_kv_cache(self, device: str, num_kv_blocks: int) -> None:
        """Create the arena; once, after the weights are on the device."""
        if self.kv_cache is not None:
            raise RuntimeError("the KV arena is already allocated")
        mc = self.model_config
        shape = (num_kv_blocks, mc.num_layers, 2, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_cache = make_kv_cache(device, shape, self.ops.kv_dtype)

    def prepare(self, batch: ScheduledBatch) -> tuple[ForwardBatch, list[Sequence]]:
        """Host-side metadata for the step, then one copy to the device. The sequences that
        reach their last token this step sample; the others are mid-prefill chunks."""
        bs = self.block_size
        seqs, num_new_tokens = batch.seqs, batch.num_new_tokens
        num_seqs, num_tokens = len(seqs), sum(num_new_tokens)
        max_blocks = max(len(seq.block_ids) for seq in seqs)
        # Every int32 input lives in one host buffer, so the step costs one host-to-device copy:
        # token ids, positions, slots, block tables, cu_seqlens, context lens, logits indices.
        sizes = (num_tokens, num_tokens, num_tokens, num_seqs * max_blocks, num_seqs + 1,
                 num_seqs, num_seqs)
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        host = np.zeros(bounds[-1], dtype=np.int32)
        token_ids, positions, slots, tables, cu_seqlens, context_lens, logits_indices = (
            host[a:b] for a, b in zip(bounds, bounds[1:]))
        tables = tables.reshape(num_seqs, max_blocks)
        sampling: list[Sequence] = []
        offset = 0
        for row, (seq, num_new) in enumerate(zip(seqs, num_new_tokens)):
            start = seq.num_computed_tokens
            end = start + num_new
            rows = slice(offset, offset + num_new)
            if 4 * end <= len(seq.token_bytes):  # a prompt chunk: already int32 bytes
                token_ids[rows] = np.frombuffer(seq.token_bytes, "<i4", num_new, 4 * start)
            else:
                token_ids[rows] = seq.token_ids[start:end]
            pos = np.arange(start, end, dtype=np.int32)
            blocks = np.asarray(seq.block_ids, dtype=np.int32)
            tables[row, : len(blocks)] = blocks
            positions[rows] = pos
            slots[rows] = blocks[pos // bs] * bs + pos % bs
            offset += num_new
            cu_seqlens[row + 1] = offset
            context_lens[row] = end
            if end == seq.num_tokens:
                logits_indices[len(sampling)] = offset - 1
                sampling.append(seq)
        device = self.ops.to_device(host)

        def part(i: int, size: int | None = None) -> Array:
            return device[bounds[i] : bounds[i] + (sizes[i] if size is None else size)]

        forward_batch = ForwardBatch(
            token_ids=part(0), positions=part(1), slot_mapping=part(2),
            block_tables=part(3).reshape(num_seqs, max_blocks), cu_seqlens_q=part(4),
            context_lens=part(5), logits_indices=part(6, len(sampling)),
            is_decode=all(n == 1 for n in num_new_tokens),
        )
        return forward_batch, sampling

    def forward(self, forward_batch: ForwardBatch) -> Array:
        """float32 logits for the batch's ``logits_indices`` rows."""
        return self.model.forward(forward_batch, self.kv_cache.array)

    def execute(self, batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
        """Run the step; (sequence, sampled token id) for every sequence that samples."""
        forward_batch, sampling = self.prepare(batch)
        logits = self.forward(forward_batch)
        if not sampling:
            return []
        return list(zip(sampling, self.sampler(logits, sampling)))

    def close(self) -> None:
        if self.kv_cache is not None:
            self.kv_cache.close()
