"""Block keys for a hosted engine's requests: namespaces and chained hashes over its block size.

The namespace is kvstore's ``ModelIdentity`` of the engine's model, built by the engine's
adapter from its config (vLLM's: ``offload.vllm.model_identity``; it names the engine and the
layout of its KV tensors in the architecture, so a hosted engine's blocks never mix with
kvengine's, nor a CPU backend's with a flash-attention one's), and per request the
``cache_salt`` (tenant) and LoRA.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvstore.keys import ModelIdentity, Namespace, chain_hashes, chain_idents, encode_tokens


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

    def __init__(self, identity: ModelIdentity) -> None:
        self.identity = identity
        self.block_size = identity.block_size
        self._current = identity  # with the resets so far in its weights_id
        self._digests: dict[tuple[str, str], bytes] = {}
        self.num_resets = 0

    def reset(self) -> None:
        """Forget every block stored so far (the engine's cache reset): later keys carry the
        number of resets, so blocks stored before are never found again. Instances that reset
        as often share again (a fleet resets together after a weight update)."""
        self.num_resets += 1
        self._current = replace(self.identity,
                                weights_id=f"{self.identity.weights_id}#reset{self.num_resets}")
        self._digests.clear()

    def namespace(self, cache_salt: str | None, lora_id: str | None) -> bytes:
        key = (cache_salt or "", lora_id or "")
        digest = self._digests.get(key)
        if digest is None:
            digest = Namespace(model=self._current, tenant_salt=key[0], lora_id=key[1]).digest
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
