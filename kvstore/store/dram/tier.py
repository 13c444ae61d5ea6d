"""The DRAM tier: the pinned pool, blocks by key, the READY index, the eviction policy, pins.

Not locked itself: every method runs under the store's lock (``StoreGuard``). Pins are counted
lazily: a lease pins its DRAM blocks as a whole (``hold_lazily``), and their ``pins`` include it
only once something is about to free, evict, demote or replace a block. Every method here that
answers "is it pinned?" or frees a block counts them first, so no caller has to.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat

from kvstore.keys import HASH_BYTES
from kvstore.store.allocator import Allocation
from kvstore.store.dram.blocks import ABSENT, Block, BlockState
from kvstore.store.dram.pool import HostPool
from kvstore.store.eviction import EvictionPolicy
from kvstore.store.leases import HeldLease
from kvstore.store.store_tier import StoreTier
from kvstore.tiers import Tier

_NO_BLOCKS: dict[bytes, Block] = {}  # never written: the READY index of an unknown namespace
_PROBE_BLOCKS = 32  # a lookup finds this many blocks before it looks any further


class DramTier(StoreTier[Block]):
    """Blocks in the host pool, indexed by key and (READY ones) by namespace then hash."""

    tier = Tier.DRAM

    def __init__(self, pool: HostPool, policy: EvictionPolicy) -> None:
        self.pool = pool
        self._policy = policy
        self._blocks: dict[bytes, Block] = {}
        # The READY blocks of _blocks again, by namespace then (store) hash: a lookup finds them
        # without building a key per block.
        self._ready: dict[bytes, dict[bytes, Block]] = {}
        self._private: set[Block] = set()  # leases' copies whose key was taken meanwhile
        self._uncounted: dict[int, HeldLease] = {}  # by lease id: pins not yet in ``pins``

    # -- finding ------------------------------------------------------------------------------

    def find_ready(self, namespace: bytes, hashes: Sequence[bytes],
                   probe_all: bool) -> tuple[list[Block], Sequence[bytes]]:
        """Each hash's READY block, or ABSENT; and the hashes, as bytes if need be.

        Unless ``probe_all`` (a lower tier may continue the hit), the list may stop after the
        first block DRAM lacks: a cold miss looks at a few hashes, not at all of them.
        """
        ready = self._ready.get(namespace, _NO_BLOCKS)
        try:
            found = list(map(ready.get, hashes[:_PROBE_BLOCKS], repeat(ABSENT)))
            if len(hashes) > _PROBE_BLOCKS and (probe_all or ABSENT not in found):
                found += map(ready.get, hashes[_PROBE_BLOCKS:], repeat(ABSENT))
        except TypeError:  # unhashable buffers (bytearray): look them up as bytes
            return self.find_ready(namespace, [bytes(memoryview(h)) for h in hashes], probe_all)
        return found, hashes

    def lookup(self, key: bytes) -> Block | None:
        """The block indexed under ``key``, READY or being written (IN_FLIGHT)."""
        return self._blocks.get(key)

    def holds(self, block: Block) -> bool:
        """Whether ``block`` is still the one indexed under its key."""
        return self._blocks.get(block.key) is block

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def keys(self) -> list[bytes]:
        return list(self._blocks)  # the caller holds the store's lock

    def ready_blocks(self) -> list[Block]:
        return [b for b in self._blocks.values() if b.state is BlockState.READY]

    def view(self, block: Block, padded: bool = False) -> memoryview:
        """The block's bytes; read-only unless ``padded`` (the demoter's and filler's view)."""
        if padded:
            return self.pool.view(block.alloc, padded=True)
        return self.pool.view(block.alloc).toreadonly()

    # -- changing -----------------------------------------------------------------------------

    def reserve(self, key: bytes, ident: bytes, alloc: Allocation) -> Block:
        """Index a new IN_FLIGHT block under ``key`` (a writer fills it, then ``publish``)."""
        block = self._blocks[key] = Block(key, ident, alloc, BlockState.IN_FLIGHT)
        return block

    def publish(self, block: Block) -> None:
        """Make an IN_FLIGHT block READY: visible to lookups, tracked by the policy."""
        block.state = BlockState.READY
        self._blocks[block.key] = block
        namespace, block_hash = block.key[:HASH_BYTES], block.key[HASH_BYTES:]
        blocks = self._ready.get(namespace)
        if blocks is None:
            blocks = self._ready[namespace] = {}
        blocks[block_hash] = block
        self._policy.insert(block.key)

    def keep_private(self, block: Block) -> None:
        """A READY copy for one lease only: its key was taken by a writer meanwhile."""
        block.state = BlockState.READY
        block.indexed = False
        self._private.add(block)

    def discard(self, block: Block) -> None:
        """Forget an IN_FLIGHT block that never became READY (an aborted write)."""
        del self._blocks[block.key]
        self.pool.free(block.alloc)

    def drop(self, block: Block) -> None:
        """Remove an indexed block and free its bytes; the caller checked it is unpinned."""
        del self._blocks[block.key]
        if block.state is BlockState.READY:
            namespace = block.key[:HASH_BYTES]
            blocks = self._ready[namespace]
            del blocks[block.key[HASH_BYTES:]]
            if not blocks:
                del self._ready[namespace]  # namespaces come and go (the bytes API names them)
        self._policy.remove(block.key)
        self.pool.free(block.alloc)

    def touch(self, key: bytes) -> None:
        self._policy.touch(key)

    def touch_many(self, blocks: Iterable[Block | None]) -> None:
        touch = self._policy.touch
        for block in blocks:
            if block is not None:
                touch(block.key)

    # -- pins ---------------------------------------------------------------------------------

    def is_pinned(self, block: Block) -> bool:
        """Whether a lease or a promotion holds ``block`` (every lease's pins counted first)."""
        self.count_pins()
        return block.pins > 0

    def victims(self) -> Iterator[Block]:
        """Unpinned READY blocks not being demoted, best victim first; don't change the tier
        while iterating (collect, stop, then drop)."""
        self.count_pins()
        blocks = self._blocks
        for key in self._policy.victims():
            block = blocks[key]
            if not block.pins and not block.demoting:
                yield block

    def pin_many(self, blocks: Sequence[Block]) -> int:
        """Pin blocks in order up to the first one no longer indexed (a lease's private
        copy stays pinnable); returns how many."""
        for n, block in enumerate(blocks):
            if block.indexed and self._blocks.get(block.key) is not block:
                return n
            block.pins += 1
        return len(blocks)

    def hold_lazily(self, held: HeldLease) -> None:
        """``held``'s DRAM blocks are pinned by the lease; count them into ``pins`` later."""
        held.counted = False
        self._uncounted[held.lease.lease_id] = held

    def count_pins(self) -> None:
        """Count every lazily held lease's DRAM blocks into their ``pins``."""
        if self._uncounted:
            for held in list(self._uncounted.values()):
                self.count_lease_pins(held)

    def count_lease_pins(self, held: HeldLease) -> None:
        """Count one lease's DRAM blocks into their ``pins`` (before it lets go of one)."""
        if held.counted:
            return
        for block in held.dram:
            if block is not None:
                block.pins += 1
        held.counted = True
        del self._uncounted[held.lease.lease_id]

    def let_go(self, held: HeldLease) -> None:
        """A released lease's DRAM blocks are no longer pinned by it."""
        if not held.counted:  # its DRAM blocks never left the index: record the access only
            del self._uncounted[held.lease.lease_id]
            self.touch_many(held.dram)
            return
        for block in held.dram:
            if block is not None:
                self.unpin(block)

    def unpin(self, block: Block) -> None:
        """Drop one pin that ``pins`` counts (a lazily held lease's only after
        ``count_lease_pins``); a private copy is freed with its last pin."""
        block.pins -= 1
        if block.indexed:
            # The access a leased lookup made is recorded here: the block could not be evicted
            # before, so its place in the eviction order did not matter until now.
            self._policy.touch(block.key)
        elif block.pins == 0:
            self._private.discard(block)
            self.pool.free(block.alloc)

    # -- reporting ----------------------------------------------------------------------------

    def stats(self) -> dict:
        """The DRAM part of the store's stats (pins counted)."""
        self.count_pins()
        blocks = self._blocks.values()
        return {
            "capacity_bytes": self.pool.capacity_bytes,
            "used_bytes": self.pool.used_bytes,
            "blocks": sum(1 for b in blocks if b.state is BlockState.READY),
            "in_flight_blocks": sum(1 for b in blocks if b.state is BlockState.IN_FLIGHT),
            "pinned_blocks": sum(1 for b in blocks if b.pins) + len(self._private),
        }

    def check_integrity(self) -> None:
        """Assert pool, index and policy agree (``check_pins``: pins and allocations)."""
        self.pool.check_integrity()
        ready = {k: b for k, b in self._blocks.items() if b.state is BlockState.READY}
        assert set(self._policy.victims()) == set(ready), "policy tracks other keys than READY"
        assert {ns + h: b for ns, blocks in self._ready.items() for h, b in blocks.items()} \
            == ready and all(self._ready.values()), "READY index differs from the blocks"
        assert all(b.key == k and b.indexed for k, b in self._blocks.items())

    def check_pins(self, held_leases: Iterable[HeldLease], promoting: Iterable[Block],
                   num_demoting: int) -> None:
        """Assert allocations, pins and demotions agree with the store's parts that hold
        blocks: ``held_leases`` (every live lease), the blocks being promoted, and how many
        blocks the demoter is writing."""
        held_leases = list(held_leases)
        held_ids = {id(h) for h in held_leases}
        assert all(not h.counted and id(h) in held_ids
                   for h in self._uncounted.values()), "uncounted leases"
        self.count_pins()
        promoting = list(promoting)
        # A block being read from SSD owns its allocation before it is published or kept.
        live = list(self._blocks.values()) + list(self._private) + promoting
        assert sorted((b.alloc.offset, b.alloc.reserved_bytes) for b in live) == \
            self.pool.allocations(), "DRAM allocations differ from the blocks that own them"
        pins: Counter[int] = Counter()
        for held in held_leases:
            for block in held.dram:  # a slot pinning nothing is one the reader is done with
                if block is not None:
                    pins[id(block)] += 1
        for block in promoting:
            pins[id(block)] += 1
        for block in live:
            assert block.pins == pins[id(block)], f"block {block.key.hex()} pin count"
        assert num_demoting == sum(b.demoting for b in live), "demoting count"

    def close(self) -> None:
        """Unpin and unmap the pool (views handed out must not be used afterwards)."""
        self.pool.close()
