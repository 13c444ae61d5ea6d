"""The cuDNN side of the background plan builder's child (``kernels/plan_builder.py``): a
``CudnnAttention`` of the child's own, unsealed, builds a key's graph in line and serializes it.
A key says everything its graph depends on, so nothing else crosses the pipe."""

from __future__ import annotations

from kernels.cudnn_attention import CudnnAttention

_attention: CudnnAttention | None = None


def prepare(device: int) -> CudnnAttention:
    """This process's CUDA context on ``device`` and its cuDNN handle (once)."""
    global _attention
    if _attention is None:
        import cupy as cp

        cp.cuda.Device(device).use()
        _attention = CudnnAttention()
    return _attention


def serialized_plan(key: tuple, device: int) -> bytes:
    """``key``'s graph, built on ``device`` in this process and serialized; raises with
    cuDNN's reason where it refuses the shape."""
    attention = prepare(device)
    plan = attention.plan(key)
    if plan is None:
        raise RuntimeError(attention.refusals.get(key, "cuDNN refused the shape"))
    return plan.graph.serialize(as_bytes=True)
