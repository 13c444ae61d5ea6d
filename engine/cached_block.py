"""A registered block as the HBM prefix cache keeps it: what a hit is verified against.

One is made per registered block (a tuple: construction must be cheap); ``CHECK`` and
``TOKEN_BYTES`` read its fields for a whole prefix at C speed (``map``), as a match does.
"""

from __future__ import annotations

import operator
import struct
from typing import NamedTuple

from offload.vocab import TOKEN_ID_BYTES


class CachedBlock(NamedTuple):
    """What the prefix cache keeps beside a registered block to verify a hit (a tuple: one is
    made per registered block, so construction must be cheap)."""

    key: bytes
    check: bytes
    token_bytes: bytes  # the block's token ids as int32-LE, as the sequence encodes them
    namespace: bytes = b""
    parent_check: bytes = b""  # the previous block's full-strength hash (or the namespace)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return struct.unpack(f"<{len(self.token_bytes) // TOKEN_ID_BYTES}i", self.token_bytes)


CHECK = operator.itemgetter(CachedBlock._fields.index("check"))
TOKEN_BYTES = operator.itemgetter(CachedBlock._fields.index("token_bytes"))
