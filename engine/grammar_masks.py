"""GrammarMasks: the step's grammar masks, computed on the host and applied to the logits.

The sampler calls ``apply`` first thing, right after the runner enqueued the forward: on the GPU
the forward is still running when llguidance computes the masks of the step's constrained rows on
the host (the GIL released, several rows on its own threads), so the mask costs the step only
what is left after the forward, plus one small upload and one kernel. A batch mixes constrained
and free rows: only the constrained rows get a mask row and only they are touched. A request
whose grammar waits for the end of its reasoning (``GrammarPhase.REASONING``) is a free row.
"""

from __future__ import annotations

import numpy as np

from engine.grammar import MaskFiller
from engine.sequence import Sequence
from kernels.ops import Array, Ops


class GrammarMasks:
    """Owns the host bitmask buffer (grown to the largest step seen) and the mask filler."""

    def __init__(self, ops: Ops) -> None:
        self.ops = ops
        self._filler = MaskFiller()
        self._host = np.empty((0, 0), dtype=np.int32)

    def apply(self, logits: Array, seqs: list[Sequence]) -> Array:
        """``logits[len(seqs), V]`` with every constrained row's refused tokens at -inf, in
        place (the same array: a captured graph's output is rewritten by its next replay
        anyway)."""
        rows = [i for i, seq in enumerate(seqs)
                if seq.grammar is not None and seq.grammar.is_active]
        if not rows:
            return logits
        num_words = -(-int(logits.shape[1]) // 32)
        if self._host.shape[0] < len(rows) or self._host.shape[1] != num_words:
            self._host = np.empty((max(len(rows), self._host.shape[0]), num_words),
                                  dtype=np.int32)
        bitmask = self._host[: len(rows)]
        self._filler.fill([seqs[i].grammar for i in rows], bitmask)
        self.ops.apply_token_bitmask(logits, self.ops.to_device(bitmask),
                                     self.ops.to_device(np.asarray(rows, dtype=np.int32)))
        return logits
