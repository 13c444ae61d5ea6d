"""The connector's settings checked while vLLM builds its config, before any model loads.

vLLM 0.32 calls nothing on a connector with its ``kv_connector_extra_config`` before the engine
starts except ``requires_piecewise_for_cudagraph`` (and that only when CUDA graphs are full, not
on CPU or with ``enforce_eager``). What it always does, while ``VllmConfig`` checks the config in
the front process (its hybrid-allocator check, on by default), is ask
``KVConnectorFactory.get_connector_class(kv_transfer_config)`` for the class: both ways to the
class (the name through ``kvstore_tiered_vllm``, the module path ``offload.vllm_connector``)
hand it out through a module ``__getattr__`` that calls ``check_requested_config`` first. That
reads the config vLLM is asking for from the factory's frame; where it finds none (vLLM
changed, or the class was imported by hand) it checks nothing and the connector's constructor
refuses the same settings later. Without this, a bad key fails only after the weights load, in
every worker's traceback.
"""

from __future__ import annotations

import sys
from typing import Any

from offload.vllm.settings import check_extra_config

_MAX_DEPTH = 8  # __getattr__ <- (vLLM's registry loader) <- get_connector_class, and margin


def _requested_config() -> Any | None:
    """The ``KVTransferConfig`` that ``KVConnectorFactory.get_connector_class`` is loading the
    class for, if that call is on this thread's stack."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    code = KVConnectorFactory.get_connector_class.__func__.__code__
    frame = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        if frame.f_code is code:
            return frame.f_locals.get("kv_transfer_config")
        frame = frame.f_back
    return None


def check_requested_config(class_name: str) -> None:
    """Check the settings vLLM is loading ``class_name`` for (``SettingsError``, one line);
    nothing when vLLM is not asking or is asking for another connector."""
    config = _requested_config()
    if config is None or getattr(config, "kv_connector", None) != class_name:
        return
    check_extra_config(getattr(config, "kv_connector_extra_config", None))
