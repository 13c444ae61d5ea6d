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
