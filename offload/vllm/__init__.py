"""The vLLM adapter of our connector: what imports or mirrors vLLM's API.

``connector.py`` is the class vLLM loads (``KVStoreConnector``; ``offload/vllm_connector.py``
hands it on under the module path the docs name) and ``reports.py`` what it reports to vLLM:
the two modules that import vllm at their top. Beside them, in plain values tested without
vLLM: the scheduler side (vLLM's requests, the load budget, its KV events), the settings
(``kv_connector_extra_config``, LMCache's names) and the model's ``ModelIdentity`` read from
vLLM's config. The engine-agnostic parts (keys, plans, tensors, the block mover, the worker
side) live in ``offload/external/``.
"""
