"""The module path vLLM users name (``"kv_connector_module_path": "offload.vllm_connector"``,
README and docs/vllm.md): it hands on ``KVStoreConnector``, which lives in the vLLM adapter
(``offload/vllm/connector.py``). A public contract: keep it while that path is documented.

The class is handed out by ``__getattr__`` (never bound here) so that each time vLLM's factory
asks for it, the settings it asks with are checked first (``offload/vllm/config_check.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offload.vllm.connector import KVStoreConnector

__all__ = ["KVStoreConnector"]


def __getattr__(name: str) -> Any:
    if name != "KVStoreConnector":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from offload.vllm.config_check import check_requested_config
    from offload.vllm.connector import KVStoreConnector

    check_requested_config(name)
    return KVStoreConnector
