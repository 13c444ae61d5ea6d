"""The CUDA IPC handle of the device allocation a pointer lies in: how the daemon maps an
engine's tensors (and vLLM's device staging) into its own context."""

from __future__ import annotations

import ctypes
from typing import Any

CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
_EXPANDABLE_SEGMENTS_FIX = ("the engine's KV tensors live in torch expandable segments, which the "
                            "store cannot map by CUDA IPC: run the engine (vLLM) with "
                            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")


def cuda_ipc_handle(ptr: int) -> tuple[bytes, int]:
    """(the CUDA IPC handle of the device allocation holding ``ptr``, ``ptr``'s offset in it).

    Public driver API (NVIDIA's ``cuda-bindings``, imported here only on the GPU path): the
    allocation's base from ``cuMemGetAddressRange``, its handle from ``cuIpcGetMemHandle``, both
    in the context the memory belongs to (pushed for the two calls, whatever is current on this
    thread). ValueError for memory legacy CUDA IPC cannot export (torch's expandable segments).
    """
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise RuntimeError("the connector needs NVIDIA's cuda-bindings for CUDA tensors: pip "
                           "install cuda-bindings (the project's cuda12 or cuda13 extra)") from exc

    def checked(call: str, result: tuple) -> Any:
        """The call's outputs (one, or a list of several); RuntimeError if it failed."""
        error, *outputs = result
        if error != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{call} for 0x{int(ptr):x} failed with {error!r}")
        return outputs[0] if len(outputs) == 1 else outputs

    attribute = driver.CUpointer_attribute
    checked("cuInit", driver.cuInit(0))
    context = checked("cuPointerGetAttribute", driver.cuPointerGetAttribute(
        attribute.CU_POINTER_ATTRIBUTE_CONTEXT, int(ptr)))
    if not checked("cuPointerGetAttribute", driver.cuPointerGetAttribute(
            attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, int(ptr))):
        raise ValueError(_EXPANDABLE_SEGMENTS_FIX)
    checked("cuCtxPushCurrent", driver.cuCtxPushCurrent(context))
    try:
        base, _ = checked("cuMemGetAddressRange", driver.cuMemGetAddressRange(int(ptr)))
        handle = checked("cuIpcGetMemHandle", driver.cuIpcGetMemHandle(base))
    finally:
        driver.cuCtxPopCurrent()
    # The handle's 64 bytes, read where the binding keeps them (no attribute for them in every
    # cuda-bindings release: 13.4 dropped ``reserved``).
    return ctypes.string_at(handle.getPtr(), CUDA_IPC_HANDLE_BYTES), int(ptr) - int(base)
