"""How one of an engine's per-layer KV tensors maps onto the store's block regions.

The engine hands the connector one tensor per attention layer, in its attention backend's shape
(vLLM's: the flash-attention layout ``[2, num_blocks, block_size, kv_heads, head_dim]`` on GPU,
the CPU backend's own shape on CPU), possibly with a permuted stride order. A block of the store
is the concatenation, over layers and over every index of the dims laid out *outside* the block
dim (the K/V dim of the flash layout), of one contiguous piece: the dims laid out *inside* the
block dim. ``regions_of`` derives those pieces from shape and strides alone, never from a
guessed layout, and refuses a tensor whose per-block piece is not one dense run of bytes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

# The label of the block dim in ``TensorSpec.dim_names``.
DIM_BLOCKS = "blocks"


@dataclass(frozen=True)
class TensorSpec:
    """One layer's KV tensor as plain numbers: what ``regions_of`` needs, no torch.

    ``strides`` are in elements (torch's convention); ``offset_bytes`` is where element 0 lies in
    the buffer that is registered (0 for a tensor that starts its buffer); ``buffer_bytes`` is that
    buffer's size. ``dim_names`` label each dim (``"blocks"`` marks the block dim).
    """

    name: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    element_bytes: int
    dim_names: tuple[str, ...]
    offset_bytes: int = 0
    buffer_bytes: int = 0

    def __post_init__(self) -> None:
        if not len(self.shape) == len(self.strides) == len(self.dim_names):
            raise ValueError(f"{self.name}: shape, strides and dim_names differ in length")
        if self.dim_names.count(DIM_BLOCKS) != 1:
            raise ValueError(f"{self.name}: exactly one dim must be named {DIM_BLOCKS!r}, got "
                             f"{self.dim_names}")
        if self.element_bytes <= 0 or any(s < 0 for s in self.strides):
            raise ValueError(f"{self.name}: element size must be positive, strides >= 0")

    @property
    def block_dim(self) -> int:
        return self.dim_names.index(DIM_BLOCKS)

    @property
    def num_blocks(self) -> int:
        return self.shape[self.block_dim]


@dataclass(frozen=True)
class Piece:
    """One region of a layer: block ``b``'s bytes are ``[offset + b*block_stride, +block_bytes)``
    of the layer's buffer."""

    offset: int
    block_stride: int
    block_bytes: int


def _physical_order(spec: TensorSpec) -> list[int]:
    """Dims from outermost to innermost in memory (ties: the logical order)."""
    return sorted(range(len(spec.shape)), key=lambda d: (-spec.strides[d], d))


def split_dims(spec: TensorSpec) -> tuple[list[int], list[int]]:
    """(outer dims, inner dims) around the block dim, each in physical order; size-1 dims go
    inside (their stride says nothing)."""
    bd = spec.block_dim
    block_stride = spec.strides[bd]
    outer, inner = [], []
    for d in _physical_order(spec):
        if d == bd:
            continue
        if spec.shape[d] > 1 and spec.strides[d] > block_stride:
            outer.append(d)
        else:
            inner.append(d)
    return outer, inner


def regions_of(spec: TensorSpec) -> list[Piece]:
    """The pieces of ``spec`` in a fixed order (outer indices row-major); ValueError if a block's
    piece is not one dense run or a piece leaves the buffer."""
    outer, inner = split_dims(spec)
    eb = spec.element_bytes
    # The inner dims must tile a dense run: innermost stride 1, each next = previous extent.
    expected = 1
    for d in reversed(inner):
        if spec.shape[d] == 1:
            continue
        if spec.strides[d] != expected:
            raise ValueError(f"{spec.name}: the per-block piece is not contiguous (dim "
                             f"{spec.dim_names[d]} has stride {spec.strides[d]}, expected "
                             f"{expected}); shape {spec.shape}, strides {spec.strides}")
        expected *= spec.shape[d]
    piece_elems = math.prod(spec.shape[d] for d in inner)
    block_stride = spec.strides[spec.block_dim] * eb
    if spec.num_blocks > 1 and block_stride < piece_elems * eb:
        raise ValueError(f"{spec.name}: blocks overlap (block stride {block_stride} bytes < "
                         f"piece {piece_elems * eb} bytes)")
    pieces = []
    for idx in itertools.product(*(range(spec.shape[d]) for d in outer)):
        offset = spec.offset_bytes + eb * sum(i * spec.strides[d] for i, d in zip(idx, outer))
        pieces.append(Piece(offset, block_stride, piece_elems * eb))
    if spec.buffer_bytes:
        for p in pieces:
            end = p.offset + (spec.num_blocks - 1) * p.block_stride + p.block_bytes
            if end > spec.buffer_bytes:
                raise ValueError(f"{spec.name}: block {spec.num_blocks - 1} ends at byte {end}, "
                                 f"past its buffer of {spec.buffer_bytes}")
    return pieces


def layout_signature(spec: TensorSpec) -> str:
    """What a block's bytes mean for this tensor: outer dims, then the piece's dims, by name and
    size in physical order (e.g. ``d0=2|d2=128.d3=2.d4=32``). Equal signatures (and dtype,
    model) mean interchangeable bytes; it goes into the namespace."""
    outer, inner = split_dims(spec)
    def fmt(dims: list[int]) -> str:
        return ".".join(f"{spec.dim_names[d]}={spec.shape[d]}" for d in dims)
    return f"{fmt(outer)}|{fmt(inner)}"


def name_dims(shape: tuple[int, ...], strides: tuple[int, ...],
              num_blocks: int) -> tuple[str, ...]:
    """Label the block dim of a KV tensor (the others ``d0``, ``d1``...): the dim of size
    ``num_blocks``; when several dims have that size (16 blocks of 16 tokens), the one laid out
    outermost, since no paged layout stores a block's tokens outside its blocks (vLLM's
    permute [layers, blocks, heads, tokens, content] with tokens and content always inside
    blocks). Equal strides too: an error, never a guess."""
    candidates = [i for i, s in enumerate(shape) if s == num_blocks]
    if len(candidates) > 1:
        top = max(strides[i] for i in candidates)
        candidates = [i for i in candidates if strides[i] == top]
    if len(candidates) != 1:
        raise ValueError(f"cannot tell the block dim of shape {shape}, strides {strides} "
                         f"({num_blocks} blocks)")
    return tuple(DIM_BLOCKS if i == candidates[0] else f"d{i}" for i in range(len(shape)))
