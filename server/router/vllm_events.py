"""vLLM's KV events as the router reads them: plain values out of one published batch.

vLLM publishes a ``KVEventBatch`` per step on its ZMQ publisher (``--kv-events-config``), as
msgpack: ``[ts, [event, ...], data_parallel_rank?]``. Two encodings of an event are in the
field. Since vLLM 0.11 an event is a map tagged by its class name (``{"type": "BlockStored",
"block_hashes": [...], ...}``); before, it was an array whose first item is the tag and whose
fields follow in declaration order (``["BlockStored", hashes, parent, token_ids, block_size,
lora_id, medium]``, trailing defaults left out). Block hashes are bytes today and were ints;
either serves as a key. The decoder reads msgpack itself (no vLLM import: the router runs
without vLLM) and refuses what it cannot read with ``EventFormatError``; unknown event types
are skipped (a newer vLLM may add some).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

# vLLM's medium for its own KV cache; a connector's events name other media (CPU, STORAGE).
GPU_MEDIUM = "GPU"

BlockKey = bytes | int  # vLLM's block hash: bytes (0.11+) or an int (before)


class EventFormatError(ValueError):
    """A payload that is not a vLLM KV event batch."""


@dataclass(frozen=True)
class Stored:
    """Consecutive blocks of one chain now cached at ``medium`` (None: vLLM's GPU cache)."""

    block_hashes: list[BlockKey]
    parent_block_hash: BlockKey | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # per block: LoRA name, (mm id, offset), salt, digests
    group_idx: int | None = None  # the KV cache group (hybrid models); None: the only one


@dataclass(frozen=True)
class Removed:
    block_hashes: list[BlockKey]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class Cleared:
    """vLLM dropped every block (a cache reset)."""


Event = Stored | Removed | Cleared


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


# Field order of the array encoding (vLLM before 0.11), after the tag.
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def decode_batch(payload: bytes) -> EventBatch:
    """One published payload as an ``EventBatch``; EventFormatError if it is not one."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise EventFormatError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise EventFormatError("an event batch is [ts, events, rank?]")
    ts, items = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    if not isinstance(ts, int | float) or (rank is not None and not isinstance(rank, int)):
        raise EventFormatError("an event batch's ts is a number and its rank an int")
    events = [event for event in map(_event, items) if event is not None]
    return EventBatch(float(ts), events, rank)


def _fields(item: Any) -> tuple[str, dict[str, Any]] | None:
    if isinstance(item, dict):
        tag = item.get("type")
        return (tag, item) if isinstance(tag, str) else None
    if isinstance(item, list) and item and isinstance(item[0], str):
        names = _ARRAY_FIELDS.get(item[0])
        if names is None:
            return item[0], {}
        if len(item) - 1 > len(names):
            raise EventFormatError(f"{item[0]} with {len(item) - 1} fields")
        return item[0], dict(zip(names, item[1:], strict=False))
    raise EventFormatError(f"an event is a map or an array, not {type(item).__name__}")


def _event(item: Any) -> Event | None:
    parsed = _fields(item)
    if parsed is None:
        raise EventFormatError("an event map without its 'type'")
    tag, f = parsed
    try:
        if tag == "BlockStored":
            hashes = _keys(f["block_hashes"])
            token_ids, block_size = f["token_ids"], f["block_size"]
            if not isinstance(block_size, int) or block_size <= 0 or \
                    not isinstance(token_ids, list) or \
                    not all(isinstance(t, int) for t in token_ids) or \
                    len(token_ids) != len(hashes) * block_size:
                raise EventFormatError("BlockStored: token_ids must be block_size ints per block")
            parent = f.get("parent_block_hash")
            extra = f.get("extra_keys")
            if extra is not None and (not isinstance(extra, list) or len(extra) != len(hashes)):
                raise EventFormatError("BlockStored: extra_keys must have one entry per block")
            return Stored(hashes, None if parent is None else _keys([parent])[0], token_ids,
                          block_size, _text(f.get("medium")), _text(f.get("lora_name")), extra,
                          _index(f.get("group_idx")))
        if tag == "BlockRemoved":
            return Removed(_keys(f["block_hashes"]), _text(f.get("medium")),
                           _index(f.get("group_idx")))
        if tag == "AllBlocksCleared":
            return Cleared()
    except KeyError as exc:
        raise EventFormatError(f"{tag} without {exc}") from None
    return None  # an event type this router does not know: not about residency


def _keys(values: Any) -> list[BlockKey]:
    if not isinstance(values, list) or not all(
            isinstance(v, bytes | int) and not isinstance(v, bool) for v in values):
        raise EventFormatError("block hashes must be a list of bytes or ints")
    return values


def _text(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise EventFormatError(f"expected a string or nil, got {type(value).__name__}")
    return value


def _index(value: Any) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise EventFormatError(f"expected an int or nil, got {type(value).__name__}")
    return value


def first_block_salt(stored: Stored) -> tuple[str, bool]:
    """The ``cache_salt`` a chain's first block was hashed with ("" for none), and whether the
    blocks can be keyed from their token ids at all (no multimodal inputs, no prompt
    embeddings: their extra keys are not tokens)."""
    salt = ""
    for index, keys in enumerate(stored.extra_keys or ()):
        if keys is None:
            continue
        if not isinstance(keys, Sequence) or isinstance(keys, str | bytes):
            return "", False
        names = [k for k in keys if isinstance(k, str)]
        if len(names) != len(keys):
            return "", False  # (mm id, offset) pairs or embedding digests
        if stored.lora_name is not None and names and names[0] == stored.lora_name:
            names = names[1:]
        if names:
            if index > 0 or stored.parent_block_hash is not None or len(names) > 1:
                return "", False  # vLLM salts a chain's first block only
            salt = names[0]
    return salt, True
