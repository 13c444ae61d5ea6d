"""How an engine's KV buffers are laid out, as the daemon sees them (types only, no device code).

A registered engine describes its KV memory as regions. Block ``b`` of the engine is, for each
region ``r`` in order, the ``r.block_bytes`` bytes at ``r.offset + b * r.block_stride`` of that
region's buffer; the store keeps a block as the concatenation of those pieces. The engine in
``engine/`` uses one block-major arena ``kv[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]``, so one region describes it and one block is one contiguous run of bytes (2.36 MB for
Qwen3-4B).

Memory is named by possession, not by name: a CPU region's handle is the index of its memory's
file descriptor (an anonymous ``memfd``) among those the registration sends with its frame
(``SCM_RIGHTS``, ``kvstore/wire/fds.py``); ``KVLayout.fds`` holds them in the engine's process.
A GPU region's handle is a CUDA IPC handle, which only the engine that made it can give away.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

# One block generation counter: a little-endian uint64 (an aligned 8-byte word, written whole).
GENERATION_DTYPE = "<u8"
GENERATION_BYTES = 8


def _wire_int(value: object, name: str) -> int:
    """A size or count from the wire: a plain int (a float, bool or str is refused, not cast)."""
    if type(value) is not int:
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class Region:
    """One buffer of engine KV memory: where it lives and how blocks are strided inside it.

    ``handle`` names the memory: on CPU an int, the index of the memory's file descriptor among
    those sent with the registration (a memfd sealed against shrinking); on GPU the bytes of a
    CUDA IPC handle. A str (a POSIX shared-memory name, as registrations once named memory) is
    refused by the daemon: any process of the same uid could name another engine's memory.
    ``size_bytes`` is the whole buffer; every block's piece must lie inside it.
    """

    handle: bytes | int | str
    size_bytes: int
    offset: int
    block_stride: int
    block_bytes: int

    def piece_bounds(self, block_id: int) -> tuple[int, int]:
        start = self.offset + block_id * self.block_stride
        return start, start + self.block_bytes


@dataclass(frozen=True)
class KVLayout:
    """The whole description an engine registers: regions, block count, device and dtype."""

    num_blocks: int
    regions: tuple[Region, ...]
    device: str = "cpu"  # "cpu" or "cuda:N"
    dtype: str = "float32"
    meta: dict = field(default_factory=dict)  # free-form: num_layers, block_size, layout name...
    # The engine's block generations (``num_blocks`` little-endian uint64 counters, one per block
    # id, bumped by the engine whenever it reallocates a block): the index of their memory's file
    # descriptor, as a CPU region's handle is; None when the engine does not publish its resident
    # blocks (the HBM tier). A str names shared memory, which the daemon refuses.
    generations: int | str | None = None
    # This process's file descriptors of the memory the handles and ``generations`` index,
    # borrowed from the memory's owner: sent with the registration, never part of the wire form.
    fds: tuple[int, ...] = field(default=(), compare=False, repr=False)

    @property
    def block_bytes(self) -> int:
        return sum(r.block_bytes for r in self.regions)

    def with_generations(self, fd: int) -> KVLayout:
        """This layout with block generations in the memory behind ``fd`` (one more fd)."""
        return replace(self, generations=len(self.fds), fds=(*self.fds, fd))

    def validate(self) -> None:
        """Raise ValueError unless every block of every region lies inside its buffer and every
        descriptor index is a plain non-negative int."""
        if self.num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if not self.regions:
            raise ValueError("a layout needs at least one region")
        indices = [r.handle for r in self.regions if not isinstance(r.handle, (bytes, str))]
        if not isinstance(self.generations, str) and self.generations is not None:
            indices.append(self.generations)
        for index in indices:
            if type(index) is not int or index < 0:
                raise ValueError(f"a file descriptor index must be an int >= 0, got {index!r}")
        for i, r in enumerate(self.regions):
            if r.block_bytes <= 0 or r.block_stride < 0 or r.offset < 0:
                raise ValueError(f"region {i}: block_bytes, block_stride and offset must be >= 0")
            _, end = r.piece_bounds(self.num_blocks - 1)
            if end > r.size_bytes:
                raise ValueError(f"region {i}: block {self.num_blocks - 1} ends at {end}, "
                                 f"past the buffer's {r.size_bytes} bytes")

    def to_wire(self) -> dict:
        wire = asdict(self)
        del wire["fds"]  # they travel beside the frame, not in it
        return wire

    @classmethod
    def from_wire(cls, obj: dict) -> KVLayout:
        try:
            regions = tuple(Region(**r) for r in obj["regions"])
            for i, r in enumerate(regions):
                for name in ("size_bytes", "offset", "block_stride", "block_bytes"):
                    _wire_int(getattr(r, name), f"region {i}: {name}")
            layout = cls(num_blocks=_wire_int(obj["num_blocks"], "num_blocks"), regions=regions,
                         device=str(obj.get("device", "cpu")), dtype=str(obj.get("dtype", "")),
                         meta=dict(obj.get("meta") or {}),
                         generations=obj.get("generations") if obj.get("generations") != ""
                         else None)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed KV layout: {exc}") from None
        layout.validate()
        return layout
