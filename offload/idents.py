"""Store idents of a sequence's full blocks: what the daemon checks a block's bytes against."""

from __future__ import annotations

from collections.abc import Sequence

from offload.engine_view import OffloadSequence
from offload.vocab import chain_idents


def sequence_idents(seq: OffloadSequence, blocks: Sequence[int],
                    block_size: int) -> list[bytes]:
    """Idents of the sequence's full blocks ``blocks`` (ascending), from the bytes its hashes
    were made of. The full-strength chain hash is the parent: it verifies the whole prefix, even
    with truncated keys."""
    if not blocks:
        return []
    tokens = seq.encoded_tokens((blocks[-1] + 1) * block_size)
    return chain_idents(seq.namespace_digest, tokens, block_size, blocks, seq.block_checks)
