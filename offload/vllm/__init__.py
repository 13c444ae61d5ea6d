"""The vLLM adapter of our connector: what imports or mirrors vLLM's API.

The engine-agnostic parts (keys, plans, tensors, the block mover, the worker side) live in
``offload/external/``; here are vLLM's scheduler side (its requests, load budget and KV events),
its settings (``kv_connector_extra_config``, LMCache's names) and the model's ``ModelIdentity``
read from vLLM's config (``model_identity``, which imports vllm only inside that reader). The
connector class itself is ``offload/vllm_connector.py``.
"""
