"""Turns a step's logits into one token per sampling sequence, each with its own random stream."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from engine.grammar_masks import GrammarMasks
from engine.logits_processor import LogitsProcessor
from engine.logprobs import TokenLogprobs, token_logprobs
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kernels.ops import Array, Ops


class Sampler:
    """Greedy rows take the argmax; the others sample from temperature/top-k/top-p filtered
    probabilities with one uniform drawn from the request's own generator, so a seeded request
    gets the same tokens whatever it is batched with. Constrained rows (structured outputs)
    get their grammar masks first (``GrammarMasks``: refused tokens at -inf, as vLLM applies its
    bitmask before sampling); rows whose params adjust the logits (penalties, bias, min_tokens,
    min_p) then go through ``LogitsProcessor``; rows that ask for logprobs get them from the
    logits before the processor (after the mask)."""

    def __init__(self, ops: Ops, eos_token_ids: Iterable[int] = ()) -> None:
        self.ops = ops
        self.processor = LogitsProcessor(ops, eos_token_ids)
        self.grammar_masks = GrammarMasks(ops)

    def __call__(self, logits: Array, seqs: list[Sequence]
                 ) -> list[tuple[int, TokenLogprobs | None]]:
        """``logits[len(seqs), V]`` float32 on the device -> (token id, logprobs or None) per
        sequence."""
        logits = self.grammar_masks.apply(logits, seqs)  # first: overlaps the device's forward
        token_ids = self._sample(self.processor(logits, seqs), seqs)
        wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        if wanted:
            raw = self.ops.to_host(logits[self.ops.to_device(np.array(wanted))])
            entries = token_logprobs(raw, [token_ids[i] for i in wanted],
                                     [seqs[i].params.logprobs for i in wanted])
            for i, entry in zip(wanted, entries):
                logprobs[i] = entry
        return list(zip(token_ids, logprobs))

    def warm_up(self, vocab_size: int) -> None:
        """Before ready: samples one step of zero logits for a greedy row with logprobs and a
        sampled row with every adjustment (top-k, top-p, min-p, penalties, a bias, min_tokens),
        so the backend compiles what the first such request would wait for. Its rows are
        throwaway sequences: nothing a request sees changes."""
        kinds = (SamplingParams(logprobs=2),
                 SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05,
                                repetition_penalty=1.1, frequency_penalty=0.5,
                                presence_penalty=0.5, logit_bias={1: 2.0}, min_tokens=4,
                                stop_token_ids=(0,)))
        seqs = [Sequence(request_id=f"warm-up-{i}", prompt_token_ids=[1, 2, 3], params=params,
                         namespace_digest=b"", generator=np.random.default_rng(i),
                         detokenizer=None) for i, params in enumerate(kinds)]
        for seq in seqs:
            seq.token_ids.extend([2, 4])  # output tokens: the output penalties have counts
        self(self.ops.xp.zeros((len(seqs), vocab_size), dtype=np.float32), seqs)

    def _sample(self, logits: Array, seqs: list[Sequence]) -> list[int]:
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
            # a top_k past the vocabulary keeps every token: off, as vLLM's (and fits int32)
            ops.to_device(np.array([p.top_k if p.top_k < logits.shape[-1] else 0
                                    for p in params], dtype=np.int32)),
            ops.to_device(np.array([p.top_p for p in params], dtype=np.float32)),
        )
        uniforms = np.array([seqs[i].generator.random(dtype=np.float32) for i in rows],
                            dtype=np.float32)
        out[rows] = ops.to_host(ops.sample_from_probs(probs, ops.to_device(uniforms)))
        return out.tolist()
