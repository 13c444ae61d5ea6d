"""The module path vLLM users name (``"kv_connector_module_path": "offload.vllm_connector"``,
README and docs/vllm.md): it hands on ``KVStoreConnector``, which lives in the vLLM adapter
(``offload/vllm/connector.py``). A public contract: keep it while that path is documented."""

from __future__ import annotations

from offload.vllm.connector import KVStoreConnector

__all__ = ["KVStoreConnector"]
