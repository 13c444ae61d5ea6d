"""``cuMemcpyBatchAsync`` through ctypes (CPU): the structs match cuda.h's layout byte for byte,
the function type is CUDA 13's argument list, and a machine without a driver says so."""

from __future__ import annotations

import ctypes

import pytest

from kvstore.engines import cuda_batch
from kvstore.engines.cuda_batch import MEMCPY_BATCH_ASYNC, MemcpyAttributes, MemLocation
from kvstore.engines.run_arrays import RunArrays


def test_memcpy_attributes_match_cuda_h() -> None:
    # CUmemLocation {CUmemLocationType type; int id;}
    assert ctypes.sizeof(MemLocation) == 8
    assert (MemLocation.type.offset, MemLocation.id.offset) == (0, 4)
    # CUmemcpyAttributes_v1 {CUmemcpySrcAccessOrder srcAccessOrder; CUmemLocation srcLocHint;
    #                        CUmemLocation dstLocHint; unsigned int flags;}
    assert ctypes.sizeof(MemcpyAttributes) == 24
    assert ctypes.alignment(MemcpyAttributes) == 4
    offsets = [getattr(MemcpyAttributes, name).offset
               for name in ("src_access_order", "src_loc_hint", "dst_loc_hint", "flags")]
    assert offsets == [0, 4, 12, 20]


def test_batch_function_type_is_the_cuda_13_signature() -> None:
    # (CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count,
    #  CUmemcpyAttributes* attrs, size_t* attrsIdxs, size_t numAttrs, CUstream hStream)
    args = MEMCPY_BATCH_ASYNC._argtypes_
    assert len(args) == 8  # CUDA 12.8's form had a ninth, size_t* failIdx, before hStream
    assert args[:3] == (ctypes.c_void_p,) * 3
    assert args[3] is ctypes.c_size_t and args[6] is ctypes.c_size_t
    assert args[4]._type_ is MemcpyAttributes and args[5]._type_ is ctypes.c_size_t
    assert args[7] is ctypes.c_void_p
    assert MEMCPY_BATCH_ASYNC._restype_ is ctypes.c_int
    assert ctypes.sizeof(ctypes.c_size_t) == ctypes.sizeof(ctypes.c_int64)  # int64 arrays


def test_without_a_driver_the_batch_is_unavailable_and_refuses() -> None:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pass
    else:
        pytest.skip("this machine has a CUDA driver")
    assert not cuda_batch.available()
    with pytest.raises(RuntimeError):
        cuda_batch.memcpy_batch(RunArrays.of([]), 1, True, False, 0, keep_gil=False)
