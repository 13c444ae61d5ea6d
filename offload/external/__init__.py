"""The engine-agnostic half of our connector in an engine other than kvengine that hosts it.

vLLM's adapter (``offload/vllm/``) is the one today; an SGLang storage backend would be
``offload/sglang/``, beside it, and would add nothing here. An adapter turns its engine's
objects into the plain values of this package and back: the store keys of a request's blocks
(``block_keys``), each step's blocks to load and save (``plan``), the engine's KV tensors as a
``BlockMover`` (``kv_tensors``: CUDA IPC regions on GPU, a ``StagingBuffer`` on CPU), and the
``WorkerSide`` that runs the loads and saves through the shared core (``offload.core``).
Nothing here imports an engine or torch: tensors arrive duck-typed, requests as token lists, so
every part is tested without one.
"""
