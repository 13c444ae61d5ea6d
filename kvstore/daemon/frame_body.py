"""Reading one frame's body off a connection without stalling the daemon's other clients.

``StreamReader.readexactly`` gathers a body whole in the reader's buffer and then copies it out
in one C call: for a 96 MB frame (a chain of a million blocks) those copies held the GIL, so the
event loop and every other connection, for ~0.1 s (measured with py-spy, ``--gil``). A large
body instead lands piece by piece, as it arrives, in an anonymous mapping whose pages the kernel
supplies as they are first written: no step copies more than a piece.
"""

from __future__ import annotations

import asyncio
import mmap

PIECE_BYTES = 1 << 20  # the most one read copies (the reader's buffer holds less, usually)


async def read_body(reader: asyncio.StreamReader, length: int,
                    small_max: int) -> bytes | memoryview:
    """The next ``length`` bytes: ``bytes`` up to ``small_max``, else a memoryview of a private
    mapping filled a piece at a time. IncompleteReadError if the peer goes away first (its
    ``partial`` is left empty: nobody reads a torn frame)."""
    if length <= small_max:
        return await reader.readexactly(length)
    view = memoryview(mmap.mmap(-1, length))
    got = 0
    while got < length:
        piece = await reader.read(min(length - got, PIECE_BYTES))
        if not piece:
            raise asyncio.IncompleteReadError(b"", length)
        view[got:got + len(piece)] = piece
        got += len(piece)
    return view
