"""An engine's per-layer KV tensors -> a ``BlockMover``: CUDA IPC regions on GPU, staging on CPU.

Duck-typed over torch tensors (``shape``, ``stride()``, ``element_size()``, ``data_ptr()``,
``untyped_storage()``, ``is_cuda``), so it imports no torch: a connector calls it with its
engine's tensors (vLLM's), the tests with their own torch tensors shaped like them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from offload.external.block_mover import BlockMover, DirectMover, StagedMover, direct_layout
from offload.external.tensor_layout import TensorSpec, layout_signature, name_dims, regions_of


def _spec(name: str, t: Any, num_blocks: int, offset_bytes: int,
          buffer_bytes: int) -> TensorSpec:
    dims = name_dims(tuple(t.shape), tuple(t.stride()), num_blocks)
    return TensorSpec(name, tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride()),
                      int(t.element_size()), dims, offset_bytes, buffer_bytes)


def _group_kernel_blocks(t: Any, num_blocks: int) -> Any:
    """An engine may split each of its blocks into kernel blocks (vLLM does: dim 0 of
    ``num_blocks * k``); view them as ``[num_blocks, k, ...]`` so a store block is still the
    engine's whole block."""
    shape = tuple(t.shape)
    if num_blocks in shape or not shape or shape[0] % num_blocks:
        return t
    return t.unflatten(0, (num_blocks, shape[0] // num_blocks))


def host_bytes(t: Any, num_bytes: int) -> np.ndarray:
    """A writable uint8 view of ``num_bytes`` of host memory from ``t.data_ptr()`` on."""
    ptr = ctypes.cast(int(t.data_ptr()), ctypes.POINTER(ctypes.c_uint8))
    return np.ctypeslib.as_array(ptr, shape=(num_bytes,))


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


def make_mover(names: Sequence[str], tensors: Sequence[Any], num_blocks: int, num_slots: int,
               meta: dict) -> BlockMover:
    """The mover for these layers (in this order, which is the order of a block's bytes).

    GPU: each layer's regions name the CUDA IPC handle of the allocation its storage lives in
    and the storage's offset inside it (``cuda_ipc_handle``; one handle per allocation, however
    many layers share it). CPU: byte views of each layer's memory and a ``num_slots``-block
    staging buffer.
    """
    if not tensors or len(names) != len(tensors):
        raise ValueError("one name per KV tensor, at least one tensor")
    on_cuda = bool(tensors[0].is_cuda)
    if any(bool(t.is_cuda) != on_cuda for t in tensors):
        raise ValueError("KV tensors on mixed devices")
    dtype = str(tensors[0].dtype).removeprefix("torch.")
    tensors = [_group_kernel_blocks(t, num_blocks) for t in tensors]
    specs, handles, sizes = [], [], []
    handle_of: dict[int, bytes] = {}  # allocation base -> its handle, asked once
    for name, t in zip(names, tensors):
        storage = t.untyped_storage()
        start = int(t.storage_offset()) * int(t.element_size())
        if on_cuda:
            handle, alloc_offset = cuda_ipc_handle(int(storage.data_ptr()))
            handle = handle_of.setdefault(int(storage.data_ptr()) - alloc_offset, handle)
            size = alloc_offset + int(storage.nbytes())
            specs.append(_spec(name, t, num_blocks, alloc_offset + start, size))
            handles.append(handle)
            sizes.append(size)
        else:
            specs.append(_spec(name, t, num_blocks, 0, int(storage.nbytes()) - start))
    pieces = [regions_of(s) for s in specs]
    meta = {**meta, "num_layers": len(names), "tensor_layout": layout_signature(specs[0])}
    if on_cuda:
        device = f"cuda:{tensors[0].device.index or 0}"
        return DirectMover(direct_layout(handles, sizes, pieces, num_blocks, device, dtype,
                                         meta))
    views = [host_bytes(t, s.buffer_bytes) for t, s in zip(tensors, specs)]
    return StagedMover(views, pieces, num_blocks, num_slots, dtype, meta)
