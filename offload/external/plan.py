"""What a connector's scheduler side tells its worker side each step: blocks to load and save.

Plain data (it crosses from the engine's scheduler to its workers, pickled when they are
separate processes, as vLLM's are): the engine's block ids plus the store keys of the blocks
that go in or out.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request: the engine's block ids and, index for index, their store
    keys."""

    request_id: str
    block_ids: list[int]
    namespace: bytes
    hashes: list[bytes]
    idents: list[bytes]

    def __post_init__(self) -> None:
        if not len(self.block_ids) == len(self.hashes) == len(self.idents):
            raise ValueError(f"request {self.request_id}: {len(self.block_ids)} block ids, "
                             f"{len(self.hashes)} hashes, {len(self.idents)} idents")

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def chunks(self, max_blocks: int) -> list[BlockTransfer]:
        """The same transfer cut into pieces of at most ``max_blocks`` (saves stay short)."""
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, got {max_blocks}")
        n = self.num_blocks
        if n <= max_blocks:
            return [self]
        return [BlockTransfer(self.request_id, self.block_ids[i:i + max_blocks],
                              self.namespace, self.hashes[i:i + max_blocks],
                              self.idents[i:i + max_blocks]) for i in range(0, n, max_blocks)]


@dataclass
class StepPlan:
    """One step's work for the worker: async loads to start, computed blocks to save, and
    requests whose saves must end before the step's forward (``flush``: preempted, so the engine may
    hand their blocks to another request in this very step)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    flush: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.loads and not self.saves and not self.flush
