"""The vLLM-independent core of the vLLM v1 KV connector (``offload.vllm_connector``).

Nothing here imports vllm or torch: tensors arrive as ``TensorSpec`` (shape, strides, address),
requests as plain token lists, so every part is tested without vLLM.
"""
