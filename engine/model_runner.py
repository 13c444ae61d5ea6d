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
        """Host-side metadata for the step, then one copy each to the device. The sequences that
        reach their last token this step sample; the others are mid-prefill chunks."""
        bs = self.block_size
        token_ids, positions, slots = [], [], []
        cu_seqlens, context_lens, logits_indices = [0], [], []
        sampling: list[Sequence] = []
        max_blocks = max(len(seq.block_ids) for seq in batch.seqs)
        block_tables = np.zeros((len(batch.seqs), max_blocks), dtype=np.int32)
        for row, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            end = start + num_new
            pos = np.arange(start, end, dtype=np.int32)
            blocks = np.asarray(seq.block_ids, dtype=np.int32)
            block_tables[row, : len(blocks)] = blocks
            token_ids.append(np.asarray(seq.token_ids[start:end], dtype=np.int32))
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            cu_seqlens.append(cu_seqlens[-1] + num_new)
            context_lens.append(end)
            if end == seq.num_tokens:
                logits_indices.append(cu_seqlens[-1] - 1)
                sampling.append(seq)
        to_device = self.ops.to_device
        forward_batch = ForwardBatch(
            token_ids=to_device(np.concatenate(token_ids)),
            positions=to_device(np.concatenate(positions)),
            slot_mapping=to_device(np.concatenate(slots).astype(np.int32)),
            block_tables=to_device(block_tables),
            cu_seqlens_q=to_device(np.asarray(cu_seqlens, dtype=np.int32)),
            context_lens=to_device(np.asarray(context_lens, dtype=np.int32)),
            logits_indices=to_device(np.asarray(logits_indices, dtype=np.int32)),
            is_decode=all(n == 1 for n in batch.num_new_tokens),
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
