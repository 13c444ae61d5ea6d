"""Store idents of a sequence's full blocks: what the daemon checks a block's bytes against."""

from __future__ import annotations

from offload.engine_view import OffloadSequence
from offload.vocab import ident_from_bytes


def sequence_idents(seq: OffloadSequence, blocks: range | list[int],
                    block_size: int) -> list[bytes]:
    """Idents of the sequence's full blocks ``blocks`` (ascending), from the bytes its hashes
    were made of. The full-strength chain hash is the parent: it verifies the whole prefix, even
    with truncated keys."""
    if not blocks:
        return []
    step = 4 * block_size
    tokens = seq.encoded_tokens((blocks[-1] + 1) * block_size)
    checks, namespace = seq.block_checks, seq.namespace_digest
    return [ident_from_bytes(checks[j - 1] if j else namespace, tokens[j * step:(j + 1) * step])
            for j in blocks]
