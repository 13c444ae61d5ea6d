"""CUDA driver functions called through ctypes, which lets go of the GIL for the call.

CuPy's runtime wrappers hold the GIL through some calls that take long: opening an engine's IPC
handle maps its whole KV arena into the daemon (measured on H200s: the daemon's control loop ran
1.5 s late while two engines registered, and their probes took the store for hung). A function
asked of the driver here runs without the GIL, so the loop and the other workers go on.

``driver_function(name, prototype)`` asks ``cuGetProcAddress`` for the CUDA 13 form of ``name``
(so a CUDA 12.x library beside a newer driver cannot call it with another argument list); None
when the driver lacks it. ``ipc_open`` / ``ipc_close`` are ``cuIpcOpenMemHandle`` /
``cuIpcCloseMemHandle`` and ``enable_peer_access`` is ``cuCtxEnablePeerAccess`` (it maps every
allocation of the peer, engines' arenas included): call them with the device's primary context
current on the calling thread. ``retain_primary_context`` creates a device's primary context
(1-2 s on an H200, which CuPy's first ``cudaSetDevice`` on a device spends holding the GIL).
"""

from __future__ import annotations

import ctypes
import functools

PROC_VERSION = 13000  # ask for the CUDA 13 form of every function


@functools.cache
def _get_proc_address():
    """The driver's ``cuGetProcAddress_v2``, or None without a driver."""
    try:
        get = ctypes.CDLL("libcuda.so.1").cuGetProcAddress_v2
    except (OSError, AttributeError):
        return None
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                    ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
    get.restype = ctypes.c_int
    return get


@functools.cache
def driver_function(name: bytes, prototype: type) -> ctypes._CFuncPtr | None:
    """The driver's ``name`` (its CUDA 13 form) as a ``prototype`` (a ``ctypes.CFUNCTYPE``:
    called without the GIL; a ``ctypes.PYFUNCTYPE``: called holding it), or None when there is
    no driver or it lacks the function."""
    get = _get_proc_address()
    if get is None:
        return None
    pfn, status = ctypes.c_void_p(), ctypes.c_int()
    if get(name, ctypes.byref(pfn), PROC_VERSION, 0, ctypes.byref(status)) != 0 or not pfn.value:
        return None
    return prototype(pfn.value)


class IpcMemHandle(ctypes.Structure):
    """cuda.h's ``CUipcMemHandle``: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


_IPC_OPEN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), IpcMemHandle,
                             ctypes.c_uint)
_IPC_CLOSE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64)


_INIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint)
_DEVICE_GET = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int)
_PRIMARY_CTX_RETAIN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                                       ctypes.c_int)
_PRIMARY_CTX_RELEASE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)
_CTX_ENABLE_PEER_ACCESS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint)
PEER_ACCESS_ALREADY_ENABLED = 704  # CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED


class CudaDriverError(RuntimeError):
    """A driver call that failed; ``status`` is its CUresult (``cuda_fault.is_sticky`` reads
    it), None when there is no driver or it lacks the function."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _required(name: bytes, prototype: type) -> ctypes._CFuncPtr:
    """The driver's ``name``; CudaDriverError without a driver or without the function."""
    if _get_proc_address() is None:
        raise CudaDriverError("no CUDA driver (libcuda.so.1) on this machine")
    fn = driver_function(name, prototype)
    if fn is None:
        raise CudaDriverError(f"this CUDA driver has no {name.decode()}")
    return fn


def ipc_open(handle: bytes, flags: int) -> int:
    """``cuIpcOpenMemHandle``: the device address of another process's allocation, mapped
    into this one; RuntimeError with the CUresult if the driver refuses."""
    if len(handle) != ctypes.sizeof(IpcMemHandle):
        raise ValueError(f"a CUDA IPC handle has 64 bytes, not {len(handle)}")
    ptr = ctypes.c_uint64(0)
    raw = IpcMemHandle.from_buffer_copy(bytes(handle))  # all 64 bytes, zeros included
    result = _required(b"cuIpcOpenMemHandle", _IPC_OPEN)(ctypes.byref(ptr), raw, flags)
    if result != 0:
        raise CudaDriverError(f"cuIpcOpenMemHandle failed with CUresult {result}", result)
    return int(ptr.value)


def ipc_close(ptr: int) -> None:
    """``cuIpcCloseMemHandle``: unmap what ``ipc_open`` mapped."""
    result = _required(b"cuIpcCloseMemHandle", _IPC_CLOSE)(ptr)
    if result != 0:
        raise CudaDriverError(f"cuIpcCloseMemHandle(0x{ptr:x}) failed with CUresult {result}",
                              result)


def enable_peer_access(peer_ordinal: int) -> int:
    """``cuCtxEnablePeerAccess`` from the current context to ``peer_ordinal``'s primary
    context: the CUresult (0, or ``PEER_ACCESS_ALREADY_ENABLED``, or the refusal)."""
    device, peer_ctx = ctypes.c_int(0), ctypes.c_void_p(0)
    result = _required(b"cuDeviceGet", _DEVICE_GET)(ctypes.byref(device), peer_ordinal)
    if result != 0:
        return result
    result = _required(b"cuDevicePrimaryCtxRetain", _PRIMARY_CTX_RETAIN)(
        ctypes.byref(peer_ctx), device.value)
    if result != 0:
        return result
    try:
        return _required(b"cuCtxEnablePeerAccess", _CTX_ENABLE_PEER_ACCESS)(peer_ctx, 0)
    finally:  # the runtime holds the primary context too: this only drops our reference
        _required(b"cuDevicePrimaryCtxRelease", _PRIMARY_CTX_RELEASE)(device.value)


def retain_primary_context(ordinal: int) -> int:
    """``cuDevicePrimaryCtxRetain`` of device ``ordinal``: creates its primary context if it
    has none yet, and keeps a reference to it (never dropped: the caller keeps the context for
    the process's life). The CUresult."""
    result = _required(b"cuInit", _INIT)(0)
    if result != 0:
        return result
    device, ctx = ctypes.c_int(0), ctypes.c_void_p(0)
    result = _required(b"cuDeviceGet", _DEVICE_GET)(ctypes.byref(device), ordinal)
    if result != 0:
        return result
    return _required(b"cuDevicePrimaryCtxRetain", _PRIMARY_CTX_RETAIN)(ctypes.byref(ctx),
                                                                       device.value)
