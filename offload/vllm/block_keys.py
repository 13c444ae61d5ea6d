"""Block keys for vLLM's requests: the namespace and the chained hashes over vLLM's block size.

The namespace carries everything that makes two vLLM instances' blocks interchangeable: the
model (architecture, layers, KV heads, head dim, weights), the KV dtype, vLLM's block size, the
layout signature of its KV tensors (so vLLM's blocks never mix with kvengine's, nor a CPU
backend's with a flash-attention one's), and per request the ``cache_salt`` (tenant) and LoRA.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvstore.keys import (
    KV_LAYOUT_VERSION,
    ModelIdentity,
    Namespace,
    chain_hashes,
    chain_idents,
    encode_tokens,
)

# The architecture field of a vLLM namespace starts with this: kvengine's never do.
VLLM_ARCH_PREFIX = "vllm:"


@dataclass(frozen=True)
class VllmModelFacts:
    """What the connector reads from vLLM's config, as plain values."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    block_size: int
    weights_id: str
    layout_signature: str

    def identity(self) -> ModelIdentity:
        arch = f"{VLLM_ARCH_PREFIX}{self.architecture}|{self.layout_signature}"
        return ModelIdentity(architecture=arch, num_layers=self.num_layers,
                             num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                             kv_dtype=self.kv_dtype, block_size=self.block_size,
                             weights_id=self.weights_id, kv_layout_version=KV_LAYOUT_VERSION)


def weights_identity(model: str, revision: str | None = None) -> str:
    """A local checkpoint: a digest of its config.json and its weight files' names and sizes
    (a changed checkpoint gets new keys); a hub name: the name and revision."""
    path = Path(model)
    if not path.is_dir():
        return f"hub:{model}@{revision or 'main'}"
    h = hashlib.sha256()
    config = path / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        h.update(f"{f.name}:{os.stat(f).st_size};".encode())
    return "dir:" + h.hexdigest()[:32]


@dataclass(frozen=True)
class RequestKeys:
    """The keys of one request's full blocks: hash and ident (what the store verifies)."""

    namespace: bytes
    hashes: list[bytes]
    idents: list[bytes]

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


class KeyMaker:
    """Namespaces per (cache_salt, LoRA) and the chained keys of a token list."""

    def __init__(self, facts: VllmModelFacts) -> None:
        self.facts = facts
        self.block_size = facts.block_size
        self._identity = facts.identity()
        self._digests: dict[tuple[str, str], bytes] = {}
        self.num_resets = 0

    def reset(self) -> None:
        """Forget every block stored so far (vLLM's cache reset): later keys carry the number
        of resets, so blocks stored before are never found again. Instances that reset as
        often share again (a fleet resets together after a weight update)."""
        self.num_resets += 1
        self._identity = replace(self.facts.identity(),
                                 weights_id=f"{self.facts.weights_id}#reset{self.num_resets}")
        self._digests.clear()

    def namespace(self, cache_salt: str | None, lora_id: str | None) -> bytes:
        key = (cache_salt or "", lora_id or "")
        digest = self._digests.get(key)
        if digest is None:
            digest = Namespace(model=self._identity, tenant_salt=key[0], lora_id=key[1]).digest
            self._digests[key] = digest
        return digest

    def keys(self, token_ids: Sequence[int], cache_salt: str | None = None,
             lora_id: str | None = None, num_blocks: int | None = None) -> RequestKeys:
        """Keys of the first ``num_blocks`` full blocks (default: all full blocks)."""
        namespace = self.namespace(cache_salt, lora_id)
        bs = self.block_size
        full = len(token_ids) // bs if num_blocks is None else min(num_blocks,
                                                                    len(token_ids) // bs)
        blocks = range(full)
        token_bytes = encode_tokens(list(token_ids[:full * bs]))
        hashes = chain_hashes(namespace, token_bytes, bs, blocks)
        return RequestKeys(namespace, hashes,
                           chain_idents(namespace, token_bytes, bs, blocks, hashes))
