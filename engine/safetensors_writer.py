"""Streams tensors into safetensors files one at a time, so an 8 GB checkpoint never sits in memory.

The header (names, dtypes, shapes, offsets) is known up front, written first, then each tensor's
bytes are appended in header order. Large checkpoints are split into shards with an HF
``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_TAGS = {"float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2)}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # "float32", "float16" or "bfloat16"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _TAGS[self.dtype][1]


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even); uint16 bit patterns. No NaNs."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def encode_values(values: np.ndarray, dtype: str) -> bytes:
    """float32 values as the little-endian bytes of ``dtype``."""
    if dtype == "bfloat16":
        return float32_to_bf16_bits(values).astype("<u2").tobytes()
    if dtype == "float16":
        return values.astype("<f2").tobytes()
    return values.astype("<f4").tobytes()


class SafetensorsWriter:
    """One file: ``write(name, chunks)`` for each spec in order, then ``close()``."""

    def __init__(self, path: Path, specs: list[TensorSpec]) -> None:
        self.path = path
        self._specs = specs
        self._next = 0
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for spec in specs:
            header[spec.name] = {"dtype": _TAGS[spec.dtype][0], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
        self._file = path.open("wb")
        self._file.write(len(blob).to_bytes(8, "little") + blob)

    def write(self, name: str, chunks: Iterator[bytes]) -> None:
        """Append the next tensor's bytes (as chunks in row-major order)."""
        spec = self._specs[self._next]
        if spec.name != name:
            raise ValueError(f"expected tensor {spec.name!r} next, got {name!r}")
        written = 0
        for chunk in chunks:
            self._file.write(chunk)
            written += len(chunk)
        if written != spec.nbytes:
            raise ValueError(f"tensor {name!r}: wrote {written} bytes, expected {spec.nbytes}")
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._specs):
            raise ValueError(f"{self.path}: only {self._next} of {len(self._specs)} tensors "
                             "were written")


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive groups of specs, each at most ``max_shard_bytes`` (unless one tensor is)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def shard_names(num_shards: int) -> list[str]:
    if num_shards == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]


def write_index(folder: Path, shards: list[list[TensorSpec]], names: list[str]) -> None:
    """HF's index of which shard holds which tensor (only written for more than one shard)."""
    if len(shards) == 1:
        return
    weight_map = {spec.name: fname for shard, fname in zip(shards, names) for spec in shard}
    total = sum(spec.nbytes for shard in shards for spec in shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
