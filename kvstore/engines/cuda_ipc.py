"""An engine's device buffer as the daemon sees it: opened from its CUDA IPC handle.

A mapping's size is the driver's, not the engine's word: ``CudaIpcMapping`` asks
``cuMemGetAddressRange`` (NVIDIA's ``cuda-bindings``, imported only once a GPU engine registers)
how large the opened allocation really is, and the registry refuses a layout that claims more.
``can_access_peer`` says whether one device reads another's memory directly (the HBM tier's
device-to-device copies), and switches that access on.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

from kvstore.engines import cuda_driver

log = logging.getLogger(__name__)

_IPC_LAZY_ENABLE_PEER_ACCESS = 1


def _cupy():
    import cupy  # imported lazily: the CPU daemon never needs it

    return cupy


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one device."""
    try:
        return _cupy().cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@functools.lru_cache(maxsize=1)
def _driver():
    """``cuda.bindings.driver``, initialised (cuInit is per process and idempotent; CuPy has
    usually called it already)."""
    try:
        from cuda.bindings import driver  # imported lazily: the CPU daemon never needs it
    except ImportError as exc:
        raise RuntimeError("CUDA registrations need NVIDIA's cuda-bindings: install the "
                           "project's cuda12 or cuda13 extra (pip install cuda-bindings)") from exc
    (result,) = driver.cuInit(0)
    if result != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuInit failed with {result!r}")
    return driver


def allocation_range(ptr: int) -> tuple[int, int]:
    """(base address, size in bytes) of the device allocation that holds ``ptr``.

    Call with the pointer's device current (a CUDA context must be). RuntimeError with the
    driver's error if the driver does not know the address.
    """
    driver = _driver()
    result, base, size = driver.cuMemGetAddressRange(int(ptr))
    if result != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemGetAddressRange(0x{int(ptr):x}) failed with {result!r}")
    return int(base), int(size)


@functools.lru_cache(maxsize=256)
def can_access_peer(device_id: int, peer_device_id: int) -> bool:
    """True when kernels on ``device_id`` may read ``peer_device_id``'s memory in this process
    (same device too). Peer access is switched on here, once per ordered pair: being able to
    (``cudaDeviceCanAccessPeer``) is not enough, since a kernel that dereferences a peer's
    address without it reads an illegal address, and that error is sticky for the whole
    context (measured on H200s: every later CUDA call of the daemon failed)."""
    if device_id == peer_device_id:
        return True
    cp = _cupy()
    try:
        if not cp.cuda.runtime.deviceCanAccessPeer(device_id, peer_device_id):
            return False
        # Through the driver without the GIL: it maps every allocation of the peer (whole
        # arenas: the daemon's loop ran 2.3 s late on H200s as a second engine registered).
        with _context_of(device_id):
            result = cuda_driver.enable_peer_access(peer_device_id)
    except Exception:
        return False
    return result in (0, cuda_driver.PEER_ACCESS_ALREADY_ENABLED)


@functools.cache
def hold_primary_context(device_id: int) -> bool:
    """``device_id``'s primary context made (if new) without the GIL and held for the
    process's life, once per device: the daemon's first CUDA call on the device of a newly
    registered engine used to create it inside CuPy with the GIL held, and its control loop
    stalled 1.5-2.3 s on H200s. False (logged) where the driver refuses: CuPy then makes the
    context as before."""
    try:
        result = cuda_driver.retain_primary_context(device_id)
    except RuntimeError as exc:  # no driver
        result = str(exc)
    if result != 0:
        log.warning("device %d's CUDA context not made ahead (%s): made on first use", device_id,
                    result)
        return False
    return True


@contextlib.contextmanager
def _context_of(device_id: int) -> Iterator[None]:
    """``device_id``'s primary context current on this thread for driver calls (since CUDA 12
    ``cudaSetDevice`` makes it current; CuPy's ``Device`` skips the call when the device is
    already this thread's), the previous device restored after."""
    cp = _cupy()
    hold_primary_context(device_id)
    with cp.cuda.Device(device_id):
        cp.cuda.runtime.setDevice(device_id)
        yield


class CudaIpcMapping:
    """An engine's device buffer opened from its IPC handle; valid until ``close()``.

    ``mapped_bytes`` is how many bytes from ``ptr`` the opened allocation really has (the
    driver's answer), whatever size the engine claimed.
    """

    def __init__(self, handle: bytes, size_bytes: int, device_id: int) -> None:
        self.device_id = device_id
        self.size_bytes = size_bytes
        with _context_of(device_id):
            # Through the driver without the GIL: mapping a whole arena takes long.
            self.ptr = cuda_driver.ipc_open(bytes(handle), _IPC_LAZY_ENABLE_PEER_ACCESS)
            try:
                base, num_bytes = allocation_range(self.ptr)
            except BaseException:
                with contextlib.suppress(Exception):  # the first error is the one to see
                    cuda_driver.ipc_close(self.ptr)
                raise
        self.mapped_bytes = max(0, base + num_bytes - self.ptr)
        self._open = True

    def close(self) -> None:
        if self._open:
            with _context_of(self.device_id):
                cuda_driver.ipc_close(self.ptr)  # without the GIL, as it was opened
            self._open = False
