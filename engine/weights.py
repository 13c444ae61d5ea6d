"""Checkpoint tensors: every ``*.safetensors`` file of a folder, memory-mapped, read by name.

The safetensors format is an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, data_offsets) and the raw little-endian data. It is parsed here directly, rather than through
``safetensors.numpy``, because NumPy has no bfloat16: bf16 tensors come back as their uint16 bit
patterns and the backend widens (CPU) or keeps (GPU) them.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

# safetensors dtype tag -> (our name, NumPy dtype holding the raw values)
_DTYPES: dict[str, tuple[str, type]] = {
    "F32": ("float32", np.float32),
    "F16": ("float16", np.float16),
    "BF16": ("bfloat16", np.uint16),
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie: ``path`` bytes ``[start, end)``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    start: int
    end: int


def read_header(path: Path) -> list[TensorInfo]:
    """Parse and bounds-check one file's header; raise ValueError naming the file if malformed."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise ValueError(f"{path}: header length {header_len} is past the file's end")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: header is not JSON: {exc}") from None
    data_start = 8 + header_len
    infos = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tag = entry.get("dtype")
        if tag not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {tag!r}; "
                             f"supported: {', '.join(_DTYPES)}")
        dtype, np_dtype = _DTYPES[tag]
        shape = tuple(int(n) for n in entry["shape"])
        start, end = (int(n) for n in entry["data_offsets"])
        nbytes = math.prod(shape) * np.dtype(np_dtype).itemsize
        if end - start != nbytes or start < 0 or data_start + end > size:
            raise ValueError(f"{path}: tensor {name!r} has bad data offsets {start}..{end}")
        infos.append(TensorInfo(name, dtype, shape, path, data_start + start, data_start + end))
    return infos


INDEX_FILE = "model.safetensors.index.json"


def _read_index(folder: Path) -> dict[str, str] | None:
    """The index's ``weight_map`` (tensor name -> shard file name), or None without an index."""
    path = folder / INDEX_FILE
    if not path.is_file():
        return None
    try:
        weight_map = json.loads(path.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a safetensors index: {exc}") from None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(v, str) and "/" not in v and v.endswith(".safetensors")
            for v in weight_map.values()):
        raise ValueError(f"{path}: weight_map must map tensor names to .safetensors files "
                         "in the same folder")
    return weight_map


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its ``model.safetensors.index.json``
    names when there is one (other ``*.safetensors`` files, such as a consolidated copy, are not
    the model), else every ``*.safetensors`` file in the folder."""
    folder = Path(model_dir)
    weight_map = _read_index(folder)
    if weight_map is None:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in model folder {str(folder)!r}")
        return files
    files = [folder / name for name in sorted(set(weight_map.values()))]
    missing = [path.name for path in files if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"{folder / INDEX_FILE} names shards that are missing: "
                                f"{', '.join(missing)}")
    return files


class CheckpointReader:
    """The tensors of a checkpoint's safetensors files (see ``checkpoint_files``), read lazily
    through mmap. With an index, every tensor must sit in the shard the index names."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        files = checkpoint_files(self.model_dir)
        self._infos: dict[str, TensorInfo] = {}
        for path in files:
            for info in read_header(path):
                if info.name in self._infos:
                    raise ValueError(f"tensor {info.name!r} appears in both "
                                     f"{self._infos[info.name].path.name} and {path.name}")
                self._infos[info.name] = info
        weight_map = _read_index(self.model_dir)
        for name, shard in (weight_map or {}).items():
            found = self._infos.get(name)
            if found is None or found.path.name != shard:
                where = found.path.name if found is not None else "no shard"
                raise ValueError(f"{self.model_dir / INDEX_FILE} puts tensor {name!r} in "
                                 f"{shard}, but it is in {where}")
        self._maps: dict[Path, np.memmap] = {}

    def names(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise KeyError(f"checkpoint in {str(self.model_dir)!r} lacks tensor {name!r}") from None

    def read(self, name: str) -> tuple[np.ndarray, str]:
        """A read-only view of the raw values and the dtype name (bf16 as uint16 bits)."""
        info = self.info(name)
        if info.path not in self._maps:
            self._maps[info.path] = np.memmap(info.path, dtype=np.uint8, mode="r")
        raw = self._maps[info.path][info.start : info.end]
        return raw.view(_DTYPES_BY_NAME[info.dtype]).reshape(info.shape), info.dtype

    def close(self) -> None:
        self._maps.clear()


_DTYPES_BY_NAME = {name: np_dtype for name, np_dtype in _DTYPES.values()}


def weights_identity(model_dir: str | Path) -> str:
    """An id of the weights: XXH3-128 of config.json, each safetensors file's name and size, and
    samples of every tensor's bytes (its first, middle and last 4 KiB).

    It keys the KV blocks the store shares, so two checkpoints that differ only in their weight
    values (a fine-tune, a merged adapter: same config, names and sizes) must differ here, or one
    would restore the other's KV. Hashing every byte would cost seconds at start; the samples
    cost a few reads per tensor. A change confined to bytes no sample covers is the blind spot.
    """
    folder = Path(model_dir)
    h = xxhash.xxh3_128()
    h.update((folder / "config.json").read_bytes())
    for path in checkpoint_files(folder):
        h.update(f"\0{path.name}\0{path.stat().st_size}".encode())
        with path.open("rb") as f:
            for info in sorted(read_header(path), key=lambda info: info.start):
                h.update(f"\0{info.name}\0".encode())
                for offset, num_bytes in _samples(info.start, info.end):
                    f.seek(offset)
                    h.update(f.read(num_bytes))
    return h.hexdigest()


_SAMPLE_BYTES = 4096


def _samples(start: int, end: int) -> list[tuple[int, int]]:
    """(offset, length) of the samples of a tensor's bytes ``[start, end)``."""
    if end - start <= 3 * _SAMPLE_BYTES:
        return [(start, end - start)]  # small: all of it
    middle = (start + end - _SAMPLE_BYTES) // 2
    return [(start, _SAMPLE_BYTES), (middle, _SAMPLE_BYTES), (end - _SAMPLE_BYTES, _SAMPLE_BYTES)]
