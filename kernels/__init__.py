"""Kernels: the ``Ops`` interface, its NumPy reference backend and the CUDA backend."""

from __future__ import annotations

from kernels.ops import Ops


def make_ops(device: str) -> Ops:
    """The backend for a resolved device: "cpu" (NumPy float32) or "cuda" (CuPy, bf16)."""
    if device == "cpu":
        from kernels.numpy_ops import NumpyOps

        return NumpyOps()
    if device == "cuda":
        try:
            from kernels.cupy_ops import CupyOps  # type: ignore[import-not-found]
        except ImportError as exc:
            raise NotImplementedError(
                f"the CUDA backend (kernels/cupy_ops.py) is not available: {exc}"
            ) from None
        return CupyOps()
    raise ValueError(f"unknown device {device!r}; expected 'cpu' or 'cuda'")


__all__ = ["Ops", "make_ops"]
