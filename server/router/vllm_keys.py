"""VllmKeys: a prompt's two chains when the router fronts vLLM engines.

- The router's own chain over the prompt's token ids, rooted per ``cache_salt`` at
  ``events_namespace``: the keys ``EngineResidency`` gives the blocks vLLM's KV events announce,
  so a prompt finds the leading run each engine holds in its GPU cache.
- The connector's chain (``KVStoreConnector``'s keys: its model identity, the tenant's
  ``cache_salt``, tensor-parallel rank 0's shard namespace), for the daemon's ``locate`` of the
  node's DRAM and SSD. The identity is the connector's to declare: each vLLM worker registers it
  with the daemon, and the router reads it from the daemon's ``engines`` verb (``learn``). Until
  then (no vLLM registered yet) there is no store chain and the router prices HBM alone.

Both cover ``routed_blocks`` of the prompt, as ``PromptChain`` does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from kvstore.keys import (
    ModelIdentity,
    chain_hashes,
    encode_tokens,
    shard_namespace,
)
from offload.external.block_keys import KeyMaker, weights_identity
from offload.vllm.model_identity import VLLM_ARCH_PREFIX
from server.router.engine_residency import events_namespace
from server.router.prompt_chain import PromptChain, routed_blocks

logger = logging.getLogger("kvengine.router")


class VllmKeys:
    """The chains of prompts bound for vLLM engines serving ``model_dir``'s model."""

    def __init__(self, model_dir: Path | None = None) -> None:
        self._weights_id = weights_identity(str(model_dir)) if model_dir is not None else None
        self.connector: KeyMaker | None = None
        self.num_shards = 1
        self._warned = False

    @property
    def block_size(self) -> int | None:
        return self.connector.block_size if self.connector is not None else None

    def event_chain(self, token_ids: Sequence[int], cache_salt: str,
                    block_size: int) -> list[bytes]:
        """The router's keys of the prompt's servable blocks (what ``EngineResidency`` holds)."""
        blocks = routed_blocks(len(token_ids), block_size)
        root = events_namespace(cache_salt)
        return chain_hashes(root, encode_tokens(token_ids[:blocks * block_size]), block_size)

    def store_chain(self, token_ids: Sequence[int], cache_salt: str) -> PromptChain | None:
        """The connector's keys of the prompt's servable blocks, under rank 0's shard
        namespace; None while the connector's identity is unknown."""
        maker = self.connector
        if maker is None:
            return None
        blocks = routed_blocks(len(token_ids), maker.block_size)
        keys = maker.keys(token_ids, cache_salt or None, None, num_blocks=blocks)
        return PromptChain(shard_namespace(keys.namespace, 0, self.num_shards), keys.hashes,
                           keys.idents, maker.block_size)

    def learn(self, engines: Sequence[dict]) -> None:
        """Take the connector's identity from the daemon's registered engines: the vLLM one
        whose weights are this router's model's, else the only vLLM one; ambiguous or none
        leaves it as it was."""
        found: dict[ModelIdentity, int] = {}
        for engine in engines:
            raw = engine.get("model_identity")
            if not isinstance(raw, dict):
                continue
            try:
                identity = ModelIdentity(**raw)
            except (TypeError, ValueError):
                continue
            if identity.architecture.startswith(VLLM_ARCH_PREFIX):
                shards = engine.get("num_shards", 1)
                found[identity] = shards if isinstance(shards, int) and shards > 0 else 1
        ours = [i for i in found if i.weights_id == self._weights_id]
        if len(ours) == 1 or (not ours and len(found) == 1):
            identity = (ours or list(found))[0]
            if self.connector is None or self.connector.identity != identity:
                logger.info("vLLM's blocks at the daemon: %s (block size %d, %d shards)",
                            identity.architecture, identity.block_size, found[identity])
                self.connector = KeyMaker(identity)
            self.num_shards = found[identity]
        elif len(found) > 1 and self.connector is None and not self._warned:
            self._warned = True
            logger.warning("the daemon holds %d vLLM identities and none is this model's "
                           "weights: the router prices vLLM's HBM only", len(found))
