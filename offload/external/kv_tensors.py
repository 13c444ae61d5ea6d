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
from offload.external.device_mover import DeviceStagedMover
from offload.external.device_staging import PACK_CTAS, DeviceStaging
from offload.external.ipc_handle import cuda_ipc_handle
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


def make_mover(names: Sequence[str], tensors: Sequence[Any], num_blocks: int, num_slots: int,
               meta: dict, device_staging_slots: int = 0, pack_ctas: int = PACK_CTAS,
               save_slots: int | None = None) -> BlockMover:
    """The mover for these layers (in this order, which is the order of a block's bytes).

    GPU: each layer's regions name the CUDA IPC handle of the allocation its storage lives in
    and the storage's offset inside it (``cuda_ipc_handle``; one handle per allocation, however
    many layers share it); with ``device_staging_slots``, blocks go through that many slots of
    device staging instead (``DeviceStagedMover``: the worker packs the pieces, the daemon moves
    whole blocks; ``pack_ctas``: the CTAs a save's packing may use). CPU: byte views of each
    layer's memory and a ``num_slots``-block staging buffer. ``save_slots``: of a staging
    buffer's slots, how many saves may hold at once (default: half of device staging, all of
    the CPU buffer); a save past it waits for room.
    """
    if not tensors or len(names) != len(tensors):
        raise ValueError("one name per KV tensor, at least one tensor")
    on_cuda = bool(tensors[0].is_cuda)
    if any(bool(t.is_cuda) != on_cuda for t in tensors):
        raise ValueError("KV tensors on mixed devices")
    dtype = str(tensors[0].dtype).removeprefix("torch.")
    tensors = [_group_kernel_blocks(t, num_blocks) for t in tensors]
    specs, handles, sizes, bases = [], [], [], []
    handle_of: dict[int, bytes] = {}  # allocation base -> its handle, asked once
    for name, t in zip(names, tensors):
        storage = t.untyped_storage()
        start = int(t.storage_offset()) * int(t.element_size())
        if on_cuda:
            handle, alloc_offset = cuda_ipc_handle(int(storage.data_ptr()))
            base = int(storage.data_ptr()) - alloc_offset
            handle = handle_of.setdefault(base, handle)
            size = alloc_offset + int(storage.nbytes())
            specs.append(_spec(name, t, num_blocks, alloc_offset + start, size))
            handles.append(handle)
            sizes.append(size)
            bases.append(base)  # pieces' offsets are from the allocation's base
        else:
            specs.append(_spec(name, t, num_blocks, 0, int(storage.nbytes()) - start))
    pieces = [regions_of(s) for s in specs]
    meta = {**meta, "num_layers": len(names), "tensor_layout": layout_signature(specs[0])}
    if on_cuda and device_staging_slots > 0:
        flat = [(base + p.offset, p.block_stride, p.block_bytes)
                for base, layer in zip(bases, pieces) for p in layer]
        staging = DeviceStaging(device_staging_slots, *zip(*flat), device=tensors[0].device,
                                pack_ctas=pack_ctas)
        return DeviceStagedMover(staging, num_blocks, dtype, meta, save_room=(
            device_staging_slots // 2 if save_slots is None else save_slots))
    if on_cuda:
        device = f"cuda:{tensors[0].device.index or 0}"
        return DirectMover(direct_layout(handles, sizes, pieces, num_blocks, device, dtype,
                                         meta))
    views = [host_bytes(t, s.buffer_bytes) for t, s in zip(tensors, specs)]
    return StagedMover(views, pieces, num_blocks, num_slots, dtype, meta, save_room=save_slots)
