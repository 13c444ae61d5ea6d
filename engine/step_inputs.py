"""A step's int32 metadata packed into one host buffer, so the step costs one host-to-device copy.

The buffer holds, in order: token ids, positions, slots, block tables, cu_seqlens, context lens,
logits indices. The logits indices list the sampling rows (one per sequence that reaches its last
token), then the prompt-logprob rows (``Sequence.prompt_logprob_positions``, in batch order):
only requests that ask for prompt logprobs add any, so the others' steps keep their shape.

``num_rows`` / ``table_width`` pad the batch to a fixed shape (CUDA graph buckets): padded rows
decode token 0 at position 0 into no slot (slot -1 is skipped by ``write_kv``) over a one-token
context in block 0, so every kernel stays in bounds; their logits are computed and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.sequence import Sequence

_FIELDS = ("token_ids", "positions", "slot_mapping", "block_tables", "cu_seqlens_q",
           "context_lens", "logits_indices")


@dataclass(frozen=True)
class StepLayout:
    """Where each field sits in the packed buffer, for ``num_tokens`` rows and a table width."""

    num_tokens: int
    num_seqs: int
    table_width: int
    num_prompt_rows: int = 0  # logits rows for prompt logprobs, after the sampling rows

    @property
    def sizes(self) -> tuple[int, ...]:
        t, b = self.num_tokens, self.num_seqs
        return (t, t, t, b * self.table_width, b + 1, b, b + self.num_prompt_rows)

    @property
    def bounds(self) -> list[int]:
        bounds = [0]
        for size in self.sizes:
            bounds.append(bounds[-1] + size)
        return bounds

    def views(self, buffer) -> dict:
        """Field name -> view of ``buffer`` (host or device); block tables are 2-D."""
        bounds = self.bounds
        out = {name: buffer[a:b] for name, a, b in zip(_FIELDS, bounds, bounds[1:])}
        out["block_tables"] = out["block_tables"].reshape(self.num_seqs, self.table_width)
        return out


def pack_step(seqs: list[Sequence], num_new_tokens: list[int], block_size: int,
              num_rows: int | None = None, table_width: int | None = None,
              ) -> tuple[np.ndarray, StepLayout, list[Sequence]]:
    """(host buffer, its layout, the sequences that sample this step, in logits order).

    Without padding the layout is exactly the batch's; its logits indices are the sampling rows,
    then ``layout.num_prompt_rows`` prompt-logprob rows (see the module docstring). With
    ``num_rows`` (decode only: one token per sequence, no prompt rows) the batch is padded to
    that many rows, every row's logits are kept (the sampling sequences first, in order) and
    ``table_width`` fixes the block table's width.
    """
    num_seqs, num_tokens = len(seqs), sum(num_new_tokens)
    width = max(len(seq.block_ids) for seq in seqs) if table_width is None else table_width
    prompt_positions = [seq.prompt_logprob_positions(n) for seq, n in zip(seqs, num_new_tokens)]
    num_prompt_rows = sum(map(len, prompt_positions))
    if num_rows is not None:
        if num_tokens != num_seqs or num_rows < num_seqs or num_prompt_rows:
            raise ValueError(f"padding to {num_rows} rows needs a decode batch of at most that "
                             f"many sequences, got {num_seqs} sequences / {num_tokens} tokens "
                             f"({num_prompt_rows} prompt-logprob rows)")
        num_seqs = num_tokens = num_rows
    layout = StepLayout(num_tokens, num_seqs, width, num_prompt_rows)
    prompt_rows: list[np.ndarray] = []
    host = np.zeros(layout.bounds[-1], dtype=np.int32)
    f = layout.views(host)
    sampling: list[Sequence] = []
    offset = 0
    for row, (seq, num_new) in enumerate(zip(seqs, num_new_tokens)):
        start = seq.num_computed_tokens
        end = start + num_new
        rows = slice(offset, offset + num_new)
        if 4 * end <= len(seq.token_bytes):  # a prompt chunk: already int32 bytes
            f["token_ids"][rows] = np.frombuffer(seq.token_bytes, "<i4", num_new, 4 * start)
        else:
            f["token_ids"][rows] = seq.token_ids[start:end]
        pos = np.arange(start, end, dtype=np.int32)
        blocks = np.asarray(seq.block_ids, dtype=np.int32)
        if len(blocks) > width:
            raise ValueError(f"a sequence holds {len(blocks)} blocks, the table has {width}")
        f["block_tables"][row, : len(blocks)] = blocks
        f["positions"][rows] = pos
        f["slot_mapping"][rows] = blocks[pos // block_size] * block_size + pos % block_size
        offset += num_new
        f["cu_seqlens_q"][row + 1] = offset
        f["context_lens"][row] = end
        if end == seq.num_tokens:
            f["logits_indices"][len(sampling)] = offset - 1
            sampling.append(seq)
        positions = prompt_positions[row]
        if positions:
            prompt_rows.append(np.arange(positions.start, positions.stop, dtype=np.int32)
                               + (offset - end))  # position p sits at row offset - end + p
    if prompt_rows:
        f["logits_indices"][len(sampling): len(sampling) + num_prompt_rows] = \
            np.concatenate(prompt_rows)
    if num_rows is not None:
        if len(sampling) != len(seqs):
            raise ValueError("a padded decode batch must sample every sequence")
        padded = slice(len(seqs), num_rows)
        f["slot_mapping"][padded] = -1
        f["context_lens"][padded] = 1
        f["cu_seqlens_q"][len(seqs) + 1:] = np.arange(len(seqs) + 1, num_rows + 1)
        f["logits_indices"][:] = np.arange(num_rows)  # row i samples sequence i; padding ignored
    return host, layout, sampling


def pack_prefill(seqs: list[Sequence], num_new_tokens: list[int], block_size: int,
                 num_tokens: int, table_width: int,
                 ) -> tuple[np.ndarray, StepLayout, list[Sequence]]:
    """A prefill step whose every sequence samples, padded to ``num_tokens`` rows and a table
    ``table_width`` wide (CUDA graph buckets of short prefills); same return as ``pack_step``.

    The padding rows follow the last sequence's own rows and extend its context by as many keys:
    query row ``i`` of a sequence sits at ``context_len - q_len + i`` (bottom-right), so its real
    rows keep their positions and, causal, never see the padding's keys (block 0 or stale slots
    past its context). Padding rows embed token 0 at position 0 into no slot (-1: no KV write);
    their outputs are computed and ignored.
    """
    host, exact, sampling = pack_step(seqs, num_new_tokens, block_size, table_width=table_width)
    if len(sampling) != len(seqs) or exact.num_prompt_rows:
        raise ValueError("a padded prefill step must sample every sequence (no mid-prompt chunk) "
                         "and compute no prompt logprobs")
    pad = num_tokens - exact.num_tokens
    if pad < 0:
        raise ValueError(f"{exact.num_tokens} tokens do not fit a {num_tokens}-row step")
    if -(-(int(max(seq.num_tokens for seq in seqs)) + pad) // block_size) > table_width:
        raise ValueError(f"the padded context does not fit a table {table_width} blocks wide")
    layout = StepLayout(num_tokens, exact.num_seqs, table_width)
    padded = np.zeros(layout.bounds[-1], dtype=np.int32)
    src, dst = exact.views(host), layout.views(padded)
    real = slice(0, exact.num_tokens)
    for name in ("token_ids", "positions", "slot_mapping"):
        dst[name][real] = src[name]
    dst["slot_mapping"][exact.num_tokens:] = -1
    for name in ("block_tables", "cu_seqlens_q", "context_lens", "logits_indices"):
        dst[name][...] = src[name]
    dst["cu_seqlens_q"][-1] += pad
    dst["context_lens"][-1] += pad
    return padded, layout, sampling
