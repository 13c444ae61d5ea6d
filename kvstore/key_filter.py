"""The key filter: which block hashes the daemon may hold, as a Bloom filter in a file that
engines map read-only, so that a lookup sure to miss is never sent.

Agent and chat traffic starts many conversations whose blocks past the shared system prompt are
new: every such first turn asked the daemon, and waited a round trip (about a millisecond beside
a busy daemon, H200 runs of the agent-tools preset) to hear "no". A Bloom filter has no false
negatives: a hash it does not hold is not in any tier, so the engine admits the request at once.
A false positive costs what every lookup cost before: the round trip.

The daemon (``KeyFilter``) sets a hash's bits before the hash can be found: a save adds its
hashes before it copies, an HBM publication before it indexes, and opening the filter adds
every block already held (an SSD tier's after a restart). Blocks leave the tiers without
clearing bits (a Bloom filter cannot), so the filter only gains bits; once as many hashes were
added since the last rebuild as the filter was sized for, a background thread rebuilds it from
the blocks held then (and the hashes added meanwhile), and writes the new bits over the old in
place: every word then holds either its old bits or its new ones, and both hold the bits of
every hash still held, so a reader never sees a live hash missing.

Engines (``KeyFilterView``) probe the bits of the first block past their HBM hit (a lookup's hit
is a prefix: if that block is not held, nothing after it is served). The filter is
``authoritative`` only where a lookup can find nothing the daemon did not add: not with
``--cluster`` (a peer's blocks are found through Redis) nor with debug-truncated hashes; a view
of a filter that is not authoritative is never opened.

File: a 64-byte header (``MAGIC``, format version, probes, bits and a random nonce the hello
names too, so a view never reads another daemon's file, as little-endian integers) then the
bits, bit ``p`` at byte ``p >> 3``, mask ``1 << (p & 7)``. A hash's probes are its four little-
endian 32-bit words, each masked to the bit count (a power of two): the hashes are XXH3-128
outputs, whose words are as good as independent hash functions. Lives beside the socket (a 0700
directory), mode 0600 (0640 and the group's with ``--socket-group``), removed when the daemon
stops.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import secrets
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from kvstore.keys import HASH_BYTES

log = logging.getLogger(__name__)

MAGIC = b"KVSTORE-KEYBITS\0"
VERSION = 1
NUM_PROBES = 4  # the 32-bit words of a 16-byte hash
_HEADER = struct.Struct("<16sIIQQ")  # magic, version, probes, bits, nonce
HEADER_BYTES = 64
MIN_BITS = 1 << 23  # 1 MiB
MAX_BITS = 1 << 29  # 64 MiB
# Sizing: bits per block the tiers could hold at this block size (the smallest a KV block
# usually is: a small model's 16 tokens); 16 bits a key keep false positives near 0.2% at four
# probes when the filter holds as many keys as it was sized for.
SIZING_BLOCK_BYTES = 64 << 10
BITS_PER_KEY = 16


def filter_bits(capacity_bytes: int) -> int:
    """The bit count for tiers of ``capacity_bytes`` in all: a power of two in
    [``MIN_BITS``, ``MAX_BITS``]."""
    wanted = max(1, capacity_bytes // SIZING_BLOCK_BYTES) * BITS_PER_KEY
    return min(MAX_BITS, max(MIN_BITS, 1 << (wanted - 1).bit_length()))


def key_filter_path(socket_path: Path) -> Path:
    """Where a daemon listening on ``socket_path`` keeps its key filter."""
    return socket_path.with_name(socket_path.name + ".keys")


def _positions(hashes: Sequence[bytes], num_bits: int) -> np.ndarray:
    """The probed bit positions of ``hashes`` (``NUM_PROBES`` each, flattened)."""
    if not hashes:
        return np.empty(0, np.uint32)
    words = np.frombuffer(b"".join(hashes), dtype="<u4")
    return words & np.uint32(num_bits - 1)


class KeyFilter:
    """The daemon's side: owns the file, adds hashes, rebuilds. Thread-safe. ``open`` creates
    the file; before it, ``add`` does nothing (the opening fill reads what the tiers hold)."""

    def __init__(self, num_bits: int, authoritative: bool = True) -> None:
        if num_bits < 8 or num_bits & (num_bits - 1):
            raise ValueError(f"the key filter's bits must be a power of two, not {num_bits}")
        self.num_bits = num_bits
        self.authoritative = authoritative
        self.path: Path | None = None
        self.nonce = secrets.randbits(63)
        self._lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self._bits: np.ndarray | None = None  # the file's bits, as bytes
        self._live: Callable[[], Iterable[bytes]] | None = None
        self._pending: list[bytes] | None = None  # added while a rebuild enumerates
        self._added_since_rebuild = 0
        self._filled_with = 0  # hashes the last fill or rebuild set
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.counts = {"added": 0, "rebuilds": 0, "rebuild_failures": 0}

    @property
    def rebuild_after(self) -> int:
        """Hashes added since the last rebuild that start the next one."""
        return self.num_bits // BITS_PER_KEY

    def open(self, path: Path, live: Callable[[], Iterable[bytes]],
             group_id: int | None = None) -> None:
        """Create the file at ``path`` (0600, or 0640 and ``group_id``'s where a group may use
        the socket; one left by a daemon that died is replaced) and fill it with ``live()``:
        the hashes held now. ``live`` is called again by rebuilds, from the filter's thread,
        without the filter's lock."""
        with self._lock:
            if self._map is not None:
                raise RuntimeError("the key filter is already open")
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if group_id is not None:  # its engines read it too (the socket's --socket-group)
                os.fchown(fd, -1, group_id)
                os.fchmod(fd, 0o640)
            os.ftruncate(fd, HEADER_BYTES + self.num_bits // 8)
            mapped = mmap.mmap(fd, HEADER_BYTES + self.num_bits // 8)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        mapped[:_HEADER.size] = _HEADER.pack(MAGIC, VERSION, NUM_PROBES, self.num_bits,
                                                self.nonce)
        with self._lock:
            self.path, self._map, self._live = path, mapped, live
            self._bits = np.frombuffer(mapped, np.uint8, self.num_bits // 8, HEADER_BYTES)
            self._pending = []  # added while ``live`` is read: kept (and set at once)
        held = [bytes(h) for h in live() if len(h) == HASH_BYTES]
        with self._lock:
            self._set(self._bits, held)
            self._filled_with = len(held) + len(self._pending)
            self._pending, self._added_since_rebuild = None, 0
        self._thread = threading.Thread(target=self._run, name="kvstore-key-filter",
                                        daemon=True)
        self._thread.start()

    def add(self, hashes: Sequence[bytes]) -> None:
        """Set the bits of ``hashes`` (16-byte block hashes; others are ignored)."""
        hashes = [bytes(h) for h in hashes if len(h) == HASH_BYTES]
        if not hashes:
            return
        with self._lock:
            if self._bits is None:
                return
            self._set(self._bits, hashes)
            if self._pending is not None:
                self._pending.extend(hashes)
            self.counts["added"] += len(hashes)
            self._added_since_rebuild += len(hashes)
            if self._added_since_rebuild >= self.rebuild_after:
                self._wake.set()

    def rebuild(self) -> None:
        """Bits from the hashes held now (and those added meanwhile) over the old ones."""
        with self._lock:
            if self._bits is None or self._live is None:
                return
            self._pending, self._added_since_rebuild = [], 0
            live = self._live
        try:
            fresh = np.zeros(self.num_bits // 8, np.uint8)
            held = [bytes(h) for h in live() if len(h) == HASH_BYTES]
            self._set(fresh, held)
        except BaseException:
            with self._lock:
                self._pending = None
            raise
        with self._lock:
            if self._bits is None:
                return
            self._set(fresh, self._pending or [])
            self._filled_with = len(held) + len(self._pending or [])
            self._added_since_rebuild = 0  # those that came meanwhile are in the fill
            self._pending = None
            # word by word, each either old (a superset of the live bits) or new
            np.copyto(self._bits, fresh)
            self.counts["rebuilds"] += 1

    def stats(self) -> dict:
        """Its size and counts; ``false_positive_estimate``: the chance that a hash never added
        reads as held, from the hashes set since the last fill (counting repeats)."""
        with self._lock:
            keys = self._filled_with + self._added_since_rebuild
            fill = 1.0 - math.exp(-NUM_PROBES * keys / self.num_bits)
            return {"bits": self.num_bits, "authoritative": self.authoritative,
                    "open": self._bits is not None, "hashes_at_last_fill": self._filled_with,
                    "added_since_rebuild": self._added_since_rebuild,
                    "false_positive_estimate": round(fill ** NUM_PROBES, 6), **self.counts}

    def describe(self) -> dict | None:
        """What the hello tells clients: the file and whether a miss in it is certain."""
        with self._lock:
            if self.path is None:
                return None
            return {"path": str(self.path), "authoritative": self.authoritative,
                    "nonce": self.nonce}

    def close(self) -> None:
        """Stop rebuilding, unmap and remove the file."""
        with self._lock:
            self._stopping = True
            self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        with self._lock:
            mapped, path = self._map, self.path
            self._bits = self._map = None
            self.path = None
        if mapped is not None:
            with contextlib.suppress(BufferError):  # a view still alive: the map goes with it
                mapped.close()
        if path is not None:
            path.unlink(missing_ok=True)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                if self._stopping:
                    return
                self._wake.clear()
            try:
                self.rebuild()
            except Exception:  # the filter only keeps more bits than it needs: still correct
                self.counts["rebuild_failures"] += 1
                log.exception("the key filter's rebuild failed; it keeps its bits")

    def _set(self, bits: np.ndarray, hashes: Sequence[bytes]) -> None:
        positions = _positions(hashes, self.num_bits)
        np.bitwise_or.at(bits, positions >> 3,
                         np.left_shift(1, positions & 7).astype(np.uint8))


def _all_set(bits, block_hash: bytes, num_bits: int, offset: int = 0) -> bool:
    """Whether every probed bit of the hash is set in ``bits`` from byte ``offset`` on (True
    for a malformed hash: never a sure miss)."""
    if len(block_hash) != HASH_BYTES:
        return True
    mask = num_bits - 1
    for word in struct.unpack("<4I", block_hash):
        position = word & mask
        if not bits[offset + (position >> 3)] & (1 << (position & 7)):
            return False
    return True


class KeyFilterView:
    """An engine's read-only map of the daemon's filter; ``may_contain`` never blocks."""

    def __init__(self, path: Path | str, nonce: int) -> None:
        """ValueError if the file is not the key filter of the daemon whose hello said
        ``nonce`` (another format, another daemon's); OSError if it cannot be opened."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise ValueError(f"{path}: {size} bytes, too short for a key filter")
            mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, probes, num_bits, theirs = _HEADER.unpack_from(mapped, 0)
        if (magic != MAGIC or version != VERSION or probes != NUM_PROBES or num_bits < 8
                or num_bits & (num_bits - 1) or size != HEADER_BYTES + num_bits // 8):
            mapped.close()
            raise ValueError(f"{path}: not a key filter of version {VERSION} "
                             f"(magic {magic!r}, version {version}, {num_bits} bits, "
                             f"{size} bytes)")
        if theirs != nonce:
            mapped.close()
            raise ValueError(f"{path}: another daemon's key filter (nonce {theirs}, the "
                             f"hello said {nonce})")
        self.path = Path(path)
        self.num_bits = num_bits
        self._map = mapped

    def may_contain(self, block_hash: bytes) -> bool:
        """False only if the daemon holds no block of this hash (True for a malformed hash)."""
        return _all_set(self._map, block_hash, self.num_bits, HEADER_BYTES)

    def close(self) -> None:
        self._map.close()
