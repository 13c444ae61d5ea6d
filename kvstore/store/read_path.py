"""The tiered store's read path: verified lookups that grant leases, reads, and ``done``.

Lookups of long chains are the hot path: READY blocks are found by namespace and hash, idents
are compared list against list, and a lease does not visit its DRAM blocks (the DRAM tier counts
their pins lazily, and records their access when the lease lets go of them). Reading an SSD
block through a lease promotes it into DRAM; ``done`` lets go of a lease's block once its reader
has copied it, so a lease may cover more SSD blocks than DRAM holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.keys import HASH_BYTES
from kvstore.store.block_store import Lease, LookupResult, StoreError, Tier
from kvstore.store.dram.blocks import ABSENT, Block, verified_len
from kvstore.store.index_keys import BAD_SIZES, IndexKeys
from kvstore.store.lease_pins import LeasePins
from kvstore.store.parts import StoreParts
from kvstore.store.promoter import Promoter


class ReadPath:
    """``lookup``, ``read`` and ``done`` of the tiered store."""

    def __init__(self, parts: StoreParts, keys: IndexKeys, leases: LeasePins,
                 promoter: Promoter) -> None:
        self._guard = parts.guard
        self._keys = keys
        self._dram = parts.dram
        self._backing = parts.backing
        # Whether a miss in DRAM may still be a hit further down: then a lookup looks up every
        # hash in DRAM, not only the first few past its first miss.
        self._probe_all = parts.backing.enabled
        self._leases = leases
        self._promoter = promoter
        self._drops = parts.drops
        self._counters = parts.counters

    def lookup(self, namespace: bytes, block_hashes: Sequence[bytes], idents: Sequence[bytes],
               lease_ttl_s: float | None, owner: str) -> LookupResult:
        """The verified prefix of the chain, leased unless ``lease_ttl_s`` is None."""
        num_blocks = len(block_hashes)
        if num_blocks != len(idents):
            raise StoreError("block_hashes and idents differ in length")
        if len(namespace) != HASH_BYTES:
            raise StoreError(BAD_SIZES)
        namespace = bytes(namespace)
        hashes = self._keys.hashes(block_hashes)
        if type(idents) is not list:
            idents = list(idents)
        want_lease = lease_ttl_s is not None
        backing = self._backing
        with self._guard.cond:
            self._guard.check_open()
            found, hashes = self._dram.find_ready(namespace, hashes, self._probe_all)
            # The common case stays in C: every block is in DRAM and every ident matches.
            stored_idents = [block.ident for block in found]
            if stored_idents == idents:
                num_dram = num_blocks
            else:
                num_dram = verified_len(found, stored_idents, idents)
                # A hash found in DRAM has the right size; the rest must be checked, before
                # anything is counted or pinned.
                if not {HASH_BYTES}.issuperset(map(len, block_hashes[num_dram:])):
                    raise StoreError(BAD_SIZES)
            dram: list[Block | None] = found if num_dram == num_blocks else found[:num_dram]
            ssd: list = [None] * num_dram  # the backing tier's entries, by block
            collided = num_dram < len(found) and found[num_dram] is not ABSENT
            if num_dram < num_blocks and not collided:
                collided = self._extend_from_ssd_locked(namespace, hashes, idents, found, dram,
                                                        ssd)
            entries = [e for e in ssd if e is not None] if len(dram) > num_dram else []
            if want_lease and entries:
                # Entries the SSD dropped since lookup_prefix (another thread's write evicted
                # them) cannot be pinned: the hit ends before the first of them.
                num_pinned = backing.pin_many(entries)
                if num_pinned < len(entries):
                    cut = ssd.index(entries[num_pinned])
                    del dram[cut:], ssd[cut:], entries[num_pinned:]
            num_hit, num_ssd = len(dram), len(entries)
            if entries:
                backing.touch_many(entries)
                tiers = [Tier.SSD if b is None else Tier.DRAM for b in dram]
            else:
                tiers = [Tier.DRAM] * num_hit
            c = self._counters
            c["lookups"] += 1
            c["lookup_blocks"] += num_blocks
            c["miss_blocks"] += num_blocks - num_hit
            c["collisions"] += collided
            c["hit_blocks_dram"] += num_hit - num_ssd
            c["hit_blocks_ssd"] += num_ssd
            if not want_lease or num_hit == 0:
                self._dram.touch_many(dram)
                return LookupResult(num_hit, tiers, None)
            # The lease's DRAM blocks are pinned by the lease itself, counted into their ``pins``
            # only when something asks; their access is recorded when the lease lets go of them.
            # A lookup whose lease ends before DRAM runs short of room never touches its blocks
            # one by one.
            lease = self._leases.grant(namespace, block_hashes[:num_hit], tiers, dram, ssd,
                                       lease_ttl_s, owner, has_dram=num_hit > num_ssd)
            return LookupResult(num_hit, tiers, lease)

    def probe(self, namespace: bytes, block_hashes: Sequence[bytes],
              idents: Sequence[bytes]) -> list[Tier]:
        """The tier of each block of the chain's verified prefix, as ``lookup`` would find it,
        leaving no trace: nothing pinned, promoted, touched (the eviction order stays as it
        was) or counted. For routers asking where a prompt's blocks are."""
        if len(block_hashes) != len(idents):
            raise StoreError("block_hashes and idents differ in length")
        if len(namespace) != HASH_BYTES or not {HASH_BYTES}.issuperset(map(len, block_hashes)):
            raise StoreError(BAD_SIZES)
        namespace = bytes(namespace)
        hashes = self._keys.hashes(block_hashes)
        idents = list(idents)
        with self._guard.cond:
            self._guard.check_open()
            found, hashes = self._dram.find_ready(namespace, hashes, self._probe_all)
            num_dram = verified_len(found, [block.ident for block in found], idents)
            dram: list[Block | None] = found[:num_dram]
            ssd: list = [None] * num_dram
            if num_dram < len(found) and found[num_dram] is ABSENT:
                self._extend_from_ssd_locked(namespace, hashes, idents, found, dram, ssd)
        return [Tier.DRAM if entry is None else Tier.SSD for entry in ssd]

    def _extend_from_ssd_locked(self, namespace: bytes, hashes: list[bytes], idents: list,
                                found: list, dram: list, ssd: list) -> bool:
        """Continue a hit past its DRAM prefix: each further block from DRAM if READY there,
        else from SSD, up to the first block neither holds. True if it stopped at a collision.
        """
        start = len(dram)
        # SSD entries of the keys DRAM lacks, in order. lookup_prefix iterates the keys once and
        # stops at the first it lacks, so they are made as it goes (a miss makes one).
        below = iter(self._backing.lookup_prefix(
            namespace + hashes[i] for i in range(start, len(found)) if found[i] is ABSENT))
        for i in range(start, len(found)):
            block = found[i]
            if block is not ABSENT:
                if block.ident != idents[i]:
                    return True
                dram.append(block)
                ssd.append(None)
                continue
            entry = next(below, None)
            if entry is None:
                return False
            if entry.ident != idents[i]:
                return True
            dram.append(None)
            ssd.append(entry)
        return False

    def read(self, lease: Lease, index: int) -> memoryview:
        """Block ``index`` of ``lease``, promoted into DRAM first if it is on SSD."""
        try:
            with self._guard.cond:
                held = self._leases.live(lease)
                _check_range(lease, index, 1, len(held.dram))
                if held.dram[index] is not None:
                    return self._dram.view(held.dram[index])
                if held.ssd[index] is None:
                    raise StoreError(f"block {index} of lease {lease.lease_id} was already done")
                return self._promoter.promote_locked(held, index)
        finally:
            if self._drops.pending:  # a promotion made room, or found its SSD copy damaged
                self._drops.report()

    def read_addresses(self, lease: Lease, start: int, count: int, num_bytes: int) -> list[int]:
        """The addresses of the range's leading DRAM blocks of ``num_bytes`` (``read`` does the
        rest: promotions and errors)."""
        address = self._dram.pool.address
        addresses: list[int] = []
        with self._guard.cond:
            held = self._leases.live(lease)
            _check_range(lease, start, count, len(held.dram))
            for block in held.dram[start:start + count]:
                if block is None or block.alloc.num_bytes != num_bytes:
                    break
                addresses.append(address(block.alloc))
        return addresses

    def done(self, lease: Lease, index: int) -> None:
        """The reader copied block ``index``: the lease stops pinning it."""
        self.done_range(lease, index, 1)

    def done_range(self, lease: Lease, start: int, count: int) -> None:
        """The reader copied blocks ``start`` .. ``start + count - 1``: the lease stops pinning
        them."""
        with self._guard.cond:
            held = self._leases.find(lease)
            if held is None:
                return  # released or expired: nothing of it is pinned any more
            _check_range(lease, start, count, len(held.dram))
            self._dram.count_lease_pins(held)
            for index in range(start, start + count):
                block, entry = held.dram[index], held.ssd[index]
                held.dram[index] = held.ssd[index] = None
                if block is not None:
                    self._dram.unpin(block)
                if entry is not None:
                    self._backing.unpin(entry)


def _check_range(lease: Lease, start: int, count: int, num_blocks: int) -> None:
    """StoreError unless ``start .. start + count - 1`` are blocks of a ``num_blocks`` lease."""
    if count < 1 or not 0 <= start <= start + count <= num_blocks:
        last = start + count - 1
        raise StoreError(f"lease {lease.lease_id} has no blocks {start}..{last} "
                         f"(it has {num_blocks})")
