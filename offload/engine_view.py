"""What the bridge sees of the engine: a sequence and the block manager, as structural types.

``offload`` never imports ``engine`` (the engine imports ``offload``); the engine's ``Sequence`` and
``BlockManager`` satisfy these protocols. The bridge reads a sequence's tokens and hashes, moves its
offload progress fields, and changes block state only through the ``BlockLedger`` methods.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol


class CachedEntry(Protocol):
    """A registered block as the prefix cache keeps it (``engine.cached_block.CachedBlock``)."""

    key: bytes
    token_bytes: bytes
    namespace: bytes
    parent_check: bytes


class Generations(Protocol):
    """Per-block counters bumped on every allocation (``offload.block_generations``)."""

    def bump(self, block_id: int) -> None: ...

    def get(self, block_id: int) -> int: ...


class OffloadSequence(Protocol):
    """One request: its hashes and tokens (read), its blocks and offload progress (moved)."""

    request_id: str
    namespace_digest: bytes
    block_hashes: list[bytes]
    block_checks: list[bytes]
    block_ids: list[int]
    num_computed_tokens: int
    num_registered_blocks: int
    offload_checked: bool
    abort_requested: bool
    num_saved_blocks: int
    restored_tokens_by_tier: dict[str, int]
    arrival_time: float  # when the request arrived (first come, first served)
    # its last landed restore: round trip sent, load landed, ready (time.monotonic())
    restore_times: tuple[float, float, float] | None

    @property
    def num_tokens(self) -> int: ...

    def encoded_tokens(self, num_tokens: int) -> bytes: ...


class BlockLedger(Protocol):
    """The block manager's methods the bridge may call (step thread only)."""

    num_blocks: int
    block_size: int

    @property
    def owed_to_running(self) -> int:
        """Blocks running prompts still need, counted now: a restore leaves them free."""

    def enable_offload(self, track_released: bool, generations: Generations | None) -> None:
        """Record evictions (and released blocks, and registrations with ``generations``)."""

    def match_prefix(self, seq: OffloadSequence) -> list[int]: ...

    def admit(self, seq: OffloadSequence, hit_block_ids: list[int], num_new_tokens: int,
              keep_free_blocks: int = 0) -> bool: ...

    def free(self, seq: OffloadSequence) -> None: ...

    def pin(self, block_ids: list[int]) -> None: ...

    def unpin(self, block_ids: list[int]) -> None: ...

    def register_computed_blocks(self, seq: OffloadSequence) -> None: ...

    def drain_evicted_keys(self) -> dict[bytes, list[bytes]]: ...

    def drain_resident(self) -> list[tuple[int, CachedEntry]]: ...

    def drain_released(self) -> list[tuple[int, CachedEntry]]: ...

    def cached_items(self) -> list[tuple[int, CachedEntry]]: ...


class RestoreOutcome(NamedTuple):
    """What ``poll`` hands the scheduler: sequences whose load landed (run them now) and
    sequences that go back to the head of the waiting queue (recompute what is missing)."""

    ready: list[OffloadSequence]
    requeue: list[OffloadSequence]
