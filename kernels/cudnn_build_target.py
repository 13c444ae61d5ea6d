"""The cuDNN side of the background plan builder's child (``kernels/plan_builder.py``): a
``CudnnAttention`` of the child's own, unsealed, builds a key's graph in line and serializes it.
A key says everything its graph depends on, so nothing else crosses the pipe."""

from __future__ import annotations

from kernels.cudnn_attention import CudnnAttention

_attention: CudnnAttention | None = None


def serialized_plan(key: tuple, device: int) -> bytes:
    """``key``'s graph, built on ``device`` in this process and serialized; raises with
    cuDNN's reason where it refuses the shape."""
    global _attention
    if _attention is None:
        import cupy as cp

        cp.cuda.Device(device).use()
        _attention = CudnnAttention()
    plan = _attention.plan(key)
    if plan is None:
        raise RuntimeError(_attention.refusals.get(key, "cuDNN refused the shape"))
    return plan.graph.serialize(as_bytes=True)
