"""The allocation size behind an IPC mapping comes from the driver through NVIDIA's cuda-bindings:
a clear error where they are missing (CPU), the real allocation's base and size on a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_without_cuda_bindings_the_size_check_says_what_to_install() -> None:
    code = ("import sys\n"
            "sys.modules['cuda'] = None  # any import of cuda.bindings now raises ImportError\n"
            "from kvstore.engines.cuda_ipc import allocation_range\n"
            "try:\n"
            "    allocation_range(1 << 40)\n"
            "except RuntimeError as exc:\n"
            "    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO_ROOT, check=True)
    assert "cuda-bindings" in done.stdout and "cuda13" in done.stdout


@pytest.mark.gpu
def test_allocation_range_finds_the_whole_allocation_from_inside_it() -> None:
    import cupy as cp

    from kvstore.engines.cuda_ipc import allocation_range

    num_bytes = 5 << 20
    memory = cp.cuda.Memory(num_bytes)  # its own cudaMalloc, not CuPy's pool
    with cp.cuda.Device(memory.device_id):
        for offset in (0, 4096, num_bytes - 1):
            base, size = allocation_range(memory.ptr + offset)
            assert base == memory.ptr and size >= num_bytes
        with pytest.raises(RuntimeError, match="cuMemGetAddressRange"):
            allocation_range(16)  # no allocation holds address 16


def test_ipc_calls_go_through_the_driver_and_say_when_it_is_missing() -> None:
    """``cuIpcOpenMemHandle`` / ``cuIpcCloseMemHandle`` through ctypes (the GIL let go): the
    handle is cuda.h's 64 bytes by value; without a driver (CPU) a clear error, and a handle
    of another size is refused before any call."""
    import ctypes

    from kvstore.engines import cuda_driver

    assert ctypes.sizeof(cuda_driver.IpcMemHandle) == 64
    raw = cuda_driver.IpcMemHandle.from_buffer_copy(bytes(range(64)))
    assert bytes(raw) == bytes(range(64))  # the zero byte and all after it kept
    with pytest.raises(ValueError, match="64 bytes"):
        cuda_driver.ipc_open(b"short", 1)
    if cuda_driver.driver_function(b"cuIpcOpenMemHandle", cuda_driver._IPC_OPEN) is None:
        with pytest.raises(RuntimeError, match="no CUDA driver|no cuIpcOpenMemHandle"):
            cuda_driver.ipc_open(bytes(64), 1)
        with pytest.raises(RuntimeError, match="no CUDA driver|no cuIpcCloseMemHandle"):
            cuda_driver.ipc_close(1 << 40)


@pytest.mark.gpu
def test_registering_a_large_arena_leaves_the_daemons_loop_running(tmp_path) -> None:
    """Opening an arena's IPC handle maps all of it; CuPy's ipcOpenMemHandle held the GIL
    meanwhile (H200s: the control loop 1.5 s late as two engines registered, their probes
    calling the store hung). Through the driver without the GIL, the loop keeps ticking."""
    import time

    import cupy as cp
    from daemon_helpers import start_daemon
    from support.arena import CudaArena

    block_bytes = 36 * 2 * 16 * 8 * 128 * 2
    free, _ = cp.cuda.runtime.memGetInfo()
    num_blocks = int(min(0.6 * free, 64 << 30) // block_bytes)
    arena = CudaArena(num_blocks, block_bytes, seed=None, generations=False)
    daemon = start_daemon(tmp_path, dram="256MiB", http=False)
    try:
        with daemon.client(timeout_s=120.0) as c:
            began = time.monotonic()
            reg = c.register(arena.layout, "large")
            registered_s = time.monotonic() - began
            began = time.monotonic()
            assert c.unregister(reg)
            unregistered_s = time.monotonic() - began
            stalls = c.stats()["daemon"]["stalls"]
        print(f"\n{num_blocks * block_bytes / 2**30:.0f} GiB arena: register "
              f"{1e3 * registered_s:.0f} ms, unregister {1e3 * unregistered_s:.0f} ms, "
              f"loop late at most {stalls['loop_lag_ms_max']:.0f} ms")
        assert stalls["loop_lag_ms_max"] < 250, stalls
    finally:
        assert daemon.stop() == 0, "\n".join(daemon.lines)


def test_without_a_driver_no_context_is_made_ahead_and_that_is_said(caplog) -> None:
    from kvstore.engines import cuda_ipc

    if cuda_ipc.cuda_driver.driver_function(b"cuInit", cuda_ipc.cuda_driver._INIT) is not None:
        pytest.skip("a CUDA driver is here")
    cuda_ipc.hold_primary_context.cache_clear()
    with caplog.at_level("WARNING"):
        assert cuda_ipc.hold_primary_context(7) is False
    assert "device 7's CUDA context not made ahead" in caplog.text


@pytest.mark.gpu
def test_an_engine_on_a_device_new_to_the_daemon_leaves_its_loop_running(tmp_path) -> None:
    """The daemon's first CUDA call on an engine's device makes its context there (1-2 s on an
    H200); CuPy made it with the GIL held (H200s: the loop 1.5-2.3 s late as the second engine
    of a node registered). Made through the driver without the GIL, the loop keeps ticking."""
    import dataclasses

    import cupy as cp
    from daemon_helpers import start_daemon
    from support.arena import CudaArena
    from support.gpus import num_cuda_devices

    if num_cuda_devices() < 2:
        pytest.skip("needs two GPUs")
    with cp.cuda.Device(1):
        arena = CudaArena(64, 36 * 2 * 16 * 8 * 128 * 2, seed=None, generations=False)
    layout = dataclasses.replace(arena.layout, device="cuda:1")
    daemon = start_daemon(tmp_path, dram="256MiB", http=False)  # its pool is on device 0
    try:
        with daemon.client(timeout_s=120.0) as c:
            reg = c.register(layout, "on-device-1")
            assert c.unregister(reg)
            stalls = c.stats()["daemon"]["stalls"]
        print(f"\nregistered on a device new to the daemon: loop late at most "
              f"{stalls['loop_lag_ms_max']:.0f} ms")
        assert stalls["loop_lag_ms_max"] < 250, stalls
    finally:
        assert daemon.stop() == 0, "\n".join(daemon.lines)
