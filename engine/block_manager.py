"""Block accounting with plain ints: ref counts, the free list and the HBM prefix cache.

Every block is in exactly one of three states: *free* (ref 0, holds nothing reusable), *cached*
(ref 0, holds a full block registered under its chained hash; evicted least recently freed first)
or *used* (ref > 0; it may also be registered, then it is shared by every sequence that hit it).
A hit is verified, not trusted: the block's stored tokens and full-strength chain hash must equal
the sequence's, else it is a miss counted as a collision. Never sees an array.

With ``--kv-offload`` the blocks of the prefix cache are also published to the store as its HBM
tier (other engines may copy them). That is safe without pinning because a cached block's bytes
never change while it stays cached, and ``generations`` (when set) is bumped for a block each
time it is allocated, before any kernel or load can write it: a copy that saw the same generation
before and after it read the bytes that were published.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable

from engine.cached_block import CHECK, TOKEN_BYTES, CachedBlock
from engine.sequence import Sequence
from offload.engine_view import Generations
from offload.vocab import TOKEN_ID_BYTES, block_token_bytes, chain_hashes, servable_blocks

# The prefix cache's versions, unique across block managers: a new one whenever a key joins or
# leaves a cache, so a sequence's remembered match (``Sequence.prefix_match``) from another
# version, or another manager, is never taken for current.
_CACHE_VERSIONS = itertools.count(1)


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Owns ``num_blocks`` block ids of one KV arena; sequences hold ids in ``block_ids``."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        debug_hash_bits: int | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.debug_hash_bits = debug_hash_bits
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._cached: dict[int, CachedBlock] = {}
        self._by_key: dict[bytes, int] = {}
        self._version = next(_CACHE_VERSIONS)  # see _CACHE_VERSIONS
        self.num_evictions = 0
        self.num_collisions = 0
        # Counts the blocks the running sequences' prompts still need (``owed_to_running``,
        # the scheduler's count: ``count_owed_with``).
        self._count_owed: Callable[[], int] = lambda: 0
        # For --kv-offload (``enable_offload``): evicted (namespace, key) pairs and, for the
        # ``evict`` policy only, cached blocks whose last reference went away; both drained once
        # per step by the offload bridge.
        self._track_offload = False
        self._track_released = False
        self._evicted: list[tuple[bytes, bytes]] = []
        self._released: list[int] = []
        # For the store's HBM tier: bumped per allocation, and the blocks registered since the
        # last drain (tracked once generations are given).
        self._generations: Generations | None = None
        self._track_resident = False
        self._registered: list[tuple[int, CachedBlock]] = []

    def enable_offload(self, track_released: bool, generations: Generations | None) -> None:
        """Start recording for the offload bridge: evictions (``drain_evicted_keys``), with
        ``track_released`` cached blocks whose last user let go (``drain_released``), with
        ``generations`` every allocation bumped there and every registration recorded
        (``drain_resident``). Call before the first allocation."""
        self._track_offload = True
        self._track_released = track_released
        self._generations = generations
        self._track_resident = generations is not None

    # -- counts -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free ones plus cached ones it may evict."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, used or not."""
        return len(self._cached)

    # -- hashing and lookup -----------------------------------------------------------------

    def update_hashes(self, seq: Sequence) -> None:
        """Extend the sequence's hash chain over every full block of its tokens. Touches only
        ``seq``: any thread may call it for a sequence the step thread does not hold yet."""
        bs = self.block_size
        start, end = len(seq.block_hashes), seq.num_tokens // bs
        if end <= start:
            return
        blocks, namespace = range(start, end), seq.namespace_digest
        tokens = seq.encoded_tokens(end * bs)
        keys = chain_hashes(namespace, tokens, bs, blocks,
                            seq.block_hashes[-1] if start else None, self.debug_hash_bits)
        if self.debug_hash_bits is None:
            checks = keys
        else:
            checks = chain_hashes(namespace, tokens, bs, blocks,
                                  seq.block_checks[-1] if start else None)
        seq.block_hashes.extend(keys)
        seq.block_checks.extend(checks)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Verified cached blocks for the longest prefix of the sequence; no side effects on
        blocks. At least one token is always left to compute, so the step has logits to sample.
        None for a sequence that owes prompt logprobs (``Sequence.reads_prefix_cache``): it
        recomputes its prompt for their logits (its blocks are still registered as computed)."""
        if not self.enable_prefix_caching or not seq.reads_prefix_cache:
            return []
        # A request is matched several times while it waits (its lookup, the queue's head,
        # admission, a restore's reservation); verifying a long prefix each time cost ~0.2 ms
        # a call. The match stands while no key joined or left the cache and no token was added.
        memo = seq.prefix_match
        if memo is not None and memo[0] == self._version and memo[1] == seq.num_tokens:
            return list(memo[2])
        hits = self._verified_prefix(seq)
        seq.prefix_match = (self._version, seq.num_tokens, tuple(hits))
        return hits

    def _verified_prefix(self, seq: Sequence) -> list[int]:
        """``match_prefix`` without its memo."""
        self.update_hashes(seq)
        num_blocks = servable_blocks(seq.num_tokens, self.block_size)
        # The candidates are the leading blocks whose keys are cached; they are verified all at
        # once (C-level compares), and block by block only when that fails.
        hits = list(map(self._by_key.get, seq.block_hashes[:num_blocks]))
        if None in hits:
            hits = hits[: hits.index(None)]
        cached = list(map(self._cached.__getitem__, hits))
        num_bytes = len(hits) * self.block_size * TOKEN_ID_BYTES
        token_bytes = seq.encoded_tokens(len(hits) * self.block_size)
        checks = seq.block_checks
        # The cached blocks' tokens (one full block's bytes each) joined are one compare;
        # slicing the sequence's bytes per block instead cost a 7k-token prompt's match ~50 us.
        if (list(map(CHECK, cached)) == checks[: len(hits)]
                and b"".join(map(TOKEN_BYTES, cached)) == token_bytes[:num_bytes]):
            return hits
        tokens = block_token_bytes(token_bytes, self.block_size, range(len(hits)))
        for j, block in enumerate(cached):
            if block.check != checks[j] or block.token_bytes != tokens[j]:
                self.num_collisions += 1
                return hits[:j]
        return hits  # every block passed on its own (the joined compare cannot fail then)

    def count_owed_with(self, count: Callable[[], int]) -> None:
        """``count()``: the blocks the running sequences still need for the tokens they
        have (their prompts, mostly) beyond the blocks they hold; the scheduler, which knows
        them, says how to count once."""
        self._count_owed = count

    @property
    def owed_to_running(self) -> int:
        """Blocks the running prompts still need, counted now: a restore, which reserves
        its whole hit at once, leaves them free (``admit``'s keep_free_blocks), so it never
        makes a prompt being prefilled preempt another (a prefill takes a chunk's blocks a
        step at a time)."""
        return self._count_owed()

    # -- allocation -------------------------------------------------------------------------

    def admittable_tokens(self, hit_block_ids: list[int]) -> int:
        """How many new tokens past the hit the free blocks could hold if admitted now."""
        hits_evictable = sum(1 for b in hit_block_ids if self._ref_counts[b] == 0)
        return (self.num_free_blocks - hits_evictable) * self.block_size

    def admit(self, seq: Sequence, hit_block_ids: list[int], num_new_tokens: int,
              keep_free_blocks: int = 0) -> bool:
        """Give a waiting sequence the hit blocks (shared) plus fresh blocks for
        ``num_new_tokens`` more tokens; False, changing nothing, if they do not fit with
        ``keep_free_blocks`` left over."""
        num_hit_tokens = len(hit_block_ids) * self.block_size
        needed = _blocks_for(num_hit_tokens + num_new_tokens, self.block_size) - len(hit_block_ids)
        if (needed + keep_free_blocks) * self.block_size > self.admittable_tokens(hit_block_ids):
            return False
        for block in hit_block_ids:
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
        seq.block_ids = list(hit_block_ids) + self._allocate_many(needed)
        seq.num_computed_tokens = num_hit_tokens
        seq.num_registered_blocks = len(hit_block_ids)
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make the sequence's blocks hold ``num_tokens`` tokens; False, changing nothing, if the
        free blocks do not suffice."""
        needed = _blocks_for(num_tokens, self.block_size) - len(seq.block_ids)
        if needed > self.num_free_blocks:
            return False
        seq.block_ids.extend(self._allocate_many(needed))
        return True

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Tail blocks are released first so that, among equally
        old cached blocks, a prefix's tail is evicted before its head."""
        refs, cached, evictable = self._ref_counts, self._cached, self._evictable
        track_released = self._track_released
        for block in reversed(seq.block_ids):
            refs[block] -= 1
            if refs[block] == 0:
                # Inlined release (one per block of a long prompt): cached blocks turn evictable.
                if block in cached:
                    evictable[block] = None
                    if track_released:
                        self._released.append(block)
                else:
                    self._free.append(block)
        seq.block_ids = []
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> int:
        """Evict every cached block no sequence uses (as vLLM's reset_prefix_cache); returns
        how many. Evictions are published like any other."""
        num_evicted = 0
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            cached = self._cached.pop(block)
            del self._by_key[cached.key]
            self._version = next(_CACHE_VERSIONS)
            if self._track_offload:
                self._evicted.append((cached.namespace, cached.key))
            self._free.append(block)
            num_evicted += 1
        self.num_evictions += num_evicted
        return num_evicted

    def pin(self, block_ids: list[int]) -> None:
        """Hold an extra reference on blocks (a copy to the store is reading them)."""
        for block in block_ids:
            if self._ref_counts[block] == 0:
                if block in self._evictable:
                    del self._evictable[block]
                else:
                    self._free.remove(block)
            self._ref_counts[block] += 1

    def unpin(self, block_ids: list[int]) -> None:
        """Drop the references ``pin`` took; unreferenced blocks become evictable again."""
        for block in block_ids:
            if self._ref_counts[block] <= 0:
                raise AssertionError(f"unpin of unreferenced block {block}")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if block in self._cached:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def drain_evicted_keys(self) -> dict[bytes, list[bytes]]:
        """Keys evicted from the prefix cache since the last call, by namespace."""
        out: dict[bytes, list[bytes]] = {}
        for namespace, key in self._evicted:
            out.setdefault(namespace, []).append(key)
        self._evicted = []
        return out

    def drain_resident(self) -> list[tuple[int, CachedBlock]]:
        """Blocks registered since the last call that still hold what they were registered with
        (not evicted meanwhile), oldest first: the HBM tier publishes these."""
        cached = self._cached
        out = [(b, c) for b, c in self._registered if cached.get(b) is c]
        self._registered = []
        return out

    def cached_items(self) -> list[tuple[int, CachedBlock]]:
        """Every registered block (used or not): republished to a store met again."""
        return list(self._cached.items())

    def drain_released(self) -> list[tuple[int, CachedBlock]]:
        """Cached blocks that lost their last reference since the last call and are still
        evictable (not yet reused): the ``evict`` offload policy saves these."""
        out = [(b, self._cached[b]) for b in self._released
               if b in self._evictable and b in self._cached]
        self._released = []
        return out

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Put every newly completed full block (K/V computed) into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        start = seq.num_registered_blocks
        if num_full <= start:
            return
        self.update_hashes(seq)
        tokens = block_token_bytes(seq.encoded_tokens(num_full * bs), bs, range(start, num_full))
        by_key, cached_blocks = self._by_key, self._cached
        hashes, checks, namespace = seq.block_hashes, seq.block_checks, seq.namespace_digest
        registered = self._registered if self._track_resident else None
        num_keys = len(by_key)
        for j in range(start, num_full):
            key = hashes[j]
            # Another sequence may have registered the same content first: keep that one.
            if key not in by_key:
                block = seq.block_ids[j]
                parent = checks[j - 1] if j else namespace
                cached = CachedBlock(key, checks[j], tokens[j - start], namespace, parent)
                cached_blocks[block] = cached
                by_key[key] = block
                if registered is not None:
                    registered.append((block, cached))
        if len(by_key) != num_keys:  # keys joined: earlier matches may be too short
            self._version = next(_CACHE_VERSIONS)
        seq.num_registered_blocks = num_full

    def _allocate_many(self, num_blocks: int) -> list[int]:
        """``num_blocks`` fresh blocks in ascending order: consecutive positions then often
        get consecutive ids (a finished sequence's blocks come back tail first), and a copy to
        or from the store moves such a run as one transfer, not one per block. Free blocks go
        first, then the least recently freed cached ones are evicted (one loop each, no call
        a block: a restore's 164 blocks under pressure cost ~0.2 ms that way)."""
        free = self._free
        blocks = [free.popleft() for _ in range(min(num_blocks, len(free)))]
        if len(blocks) < num_blocks:
            blocks += self._evict(num_blocks - len(blocks))
        if self._generations is not None:  # before anything can write the blocks again
            for block in blocks:
                self._generations.bump(block)
        refs = self._ref_counts
        for block in blocks:
            refs[block] = 1
        blocks.sort()
        return blocks

    def _evict(self, num_blocks: int) -> list[int]:
        """Take the ``num_blocks`` least recently freed cached blocks out of the cache."""
        evictable, cached, by_key = self._evictable, self._cached, self._by_key
        evicted = self._evicted if self._track_offload else None
        blocks = []
        for _ in range(num_blocks):
            block, _ = evictable.popitem(last=False)
            gone = cached.pop(block)
            del by_key[gone.key]
            if evicted is not None:
                evicted.append((gone.namespace, gone.key))
            blocks.append(block)
        self._version = next(_CACHE_VERSIONS)
        self.num_evictions += num_blocks
        return blocks

    # -- checks -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + cached + used = total and the maps agree."""
        free, evictable = set(self._free), set(self._evictable)
        used = {b for b, ref in enumerate(self._ref_counts) if ref > 0}
        _require(len(free) == len(self._free), "a block is twice in the free list")
        _require(all(ref >= 0 for ref in self._ref_counts), "a negative ref count")
        _require(not (free & evictable), "a block is both free and cached")
        _require(not (used & (free | evictable)), "a used block is on a free list")
        _require(len(free) + len(evictable) + len(used) == self.num_blocks,
                 f"free {len(free)} + cached {len(evictable)} + used {len(used)} "
                 f"!= total {self.num_blocks}")
        _require(evictable <= self._cached.keys(), "an evictable block is not registered")
        _require(not (free & self._cached.keys()), "a free block is still registered")
        _require(len(self._by_key) == len(self._cached), "hash map and block map differ")
        for block, cached in self._cached.items():
            _require(self._by_key.get(cached.key) == block, f"block {block}: hash maps elsewhere")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"block manager integrity: {message}")
