"""Turns a step's logits into one token per sampling sequence, each with its own random stream."""

from __future__ import annotations

import numpy as np

from engine.sequence import Sequence
from kernels.ops import Array, Ops


class Sampler:
    """Greedy rows take the argmax; the others sample from temperature/top-k/top-p filtered
    probabilities with one uniform drawn from the request's own generator, so a seeded request
    gets the same tokens whatever it is batched with."""

    def __init__(self, ops: Ops) -> None:
        self.ops = ops

    def __call__(self, logits: Array, seqs: list[Sequence]) -> list[int]:
        """``logits[len(seqs), V]`` float32 on the device -> one token id per sequence."""
        ops = self.ops
        greedy = np.array([s.params.greedy for s in seqs], dtype=bool)
        out = np.empty(len(seqs), dtype=np.int32)
        if greedy.all():
            return ops.to_host(ops.argmax(logits)).tolist()
        if greedy.any():
            rows = np.flatnonzero(greedy)
            out[rows] = ops.to_host(ops.argmax(logits[ops.to_device(rows)]))
        rows = np.flatnonzero(~greedy)
        params = [seqs[i].params for i in rows]
        probs = ops.sampling_probs(
            logits[ops.to_device(rows)],
            ops.to_device(np.array([p.temperature for p in params], dtype=np.float32)),
            ops.to_device(np.array([p.top_k for p in params], dtype=np.int32)),
            ops.to_device(np.array([p.top_p for p in params], dtype=np.float32)),
        )
        uniforms = np.array([seqs[i].generator.random(dtype=np.float32) for i in rows],
                            dtype=np.float32)
        out[rows] = ops.to_host(ops.sample_from_probs(probs, ops.to_device(uniforms)))
        return out.tolist()
