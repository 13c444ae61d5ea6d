"""benchmarks.process_memory names the host's GPU of a CUDA device number through
CUDA_VISIBLE_DEVICES (nvidia-smi lists every GPU of the host, whatever the process sees)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.process_memory import host_device, host_memory


def test_a_cuda_device_number_names_the_hosts_gpu() -> None:
    assert host_device(0, "") == "0" and host_device(1, "") == "1"
    assert host_device(0, "2") == "2"
    assert host_device(1, "3, 1") == "1"
    assert host_device(0, "GPU-8f2c") == "GPU-8f2c"
    with pytest.raises(ValueError, match="not among"):
        host_device(1, "2")


def test_host_memory_of_a_process_without_an_arena() -> None:
    # a fresh child, not this process: an earlier test in this one may still map an arena
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        memory = host_memory(child.pid)
    finally:
        child.kill()
        child.wait()
    assert memory["rss_bytes"] > 0 and memory["engine_arena_bytes"] == 0
