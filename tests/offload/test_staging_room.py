"""vLLM's staging room: device staging by default where CuPy can pack, split between loads and
saves as the CPU path's room is, off with 0; a bad value is one clear error."""

from __future__ import annotations

import importlib.util

import pytest

from offload.external.device_staging import DeviceStaging
from offload.vllm.settings import ConnectorSettings, SettingsError
from offload.vllm.staging_room import StagingRoom


def cupy_here() -> str | None:
    return None


def no_cupy() -> str | None:
    return "No module named 'cupy'"


BLOCK = 2_359_296  # a Qwen3-4B block of vLLM's layout


def room(on_cuda: bool = True, loads: bool = True, saves: bool = True, missing=cupy_here,
         block_bytes: int = BLOCK, **extra) -> StagingRoom:
    return StagingRoom.of(ConnectorSettings.from_extra_config(extra), loads, saves, on_cuda,
                          block_bytes, missing)


def test_device_staging_is_the_default_on_a_gpu_sized_as_the_cpu_room() -> None:
    assert room() == StagingRoom(num_slots=128, device_slots=128, save_slots=64)
    assert room(load_blocks=32, save_blocks=96) == StagingRoom(128, 128, 96)
    assert room(loads=False) == StagingRoom(64, 64, 64)  # a producer only saves
    assert room(saves=False) == StagingRoom(64, 64, 0)  # a consumer never saves
    assert room(on_cuda=False) == StagingRoom(128, 0, 64)  # CPU: the shared-memory buffer


def test_the_default_stays_off_without_cupy_or_past_its_bytes_and_says_why() -> None:
    got = room(missing=no_cupy)
    assert (got.device_slots, got.save_slots) == (0, 64)
    assert "the packing's modules do not import (No module named 'cupy')" in got.note
    assert "cuda13" in got.note
    big = room(load_blocks=400)  # 464 blocks of 2.36 MB: past 1 GiB
    assert big.device_slots == 0 and "464 blocks of 2359296 bytes" in big.note
    assert room(load_blocks=400, device_staging_blocks=464).device_slots == 464  # asked for


def test_an_explicit_size_gives_loads_their_blocks_and_saves_the_rest_and_zero_is_off() -> None:
    assert room(device_staging_blocks=100) == StagingRoom(128, 100, 36)
    assert room(device_staging_blocks=64, loads=False) == StagingRoom(64, 64, 64)
    assert room(device_staging_blocks=0) == StagingRoom(128, 0, 64)
    assert room(device_staging_blocks="0", missing=no_cupy).note is None  # asked off: no note
    assert room(on_cuda=False, device_staging_blocks=40) == StagingRoom(128, 0, 64)  # CPU
    with pytest.raises(SettingsError, match="device_staging_blocks 64 leaves no slot for saves"
                                            r".*give at least 65, or 0 for none"):
        room(device_staging_blocks=64)
    with pytest.raises(SettingsError, match="leaves too few for loads"):
        room(device_staging_blocks=40)


@pytest.mark.parametrize("value", [-1, 1.5, "many", True, None])
def test_a_bad_staging_size_is_one_line_naming_the_key(value) -> None:
    with pytest.raises(SettingsError, match=r"device_staging_blocks must be a non-negative "
                                            r"integer \(0: off\)"):
        ConnectorSettings.from_extra_config({"device_staging_blocks": value})
    with pytest.raises(SettingsError, match="load_blocks must be a positive integer"):
        ConnectorSettings.from_extra_config({"load_blocks": 0})


def test_device_staging_without_cupy_names_the_fix() -> None:
    """Asked for by size on a machine without CuPy: one clear error, before any memory is
    taken (CuPy launches the staging's copies)."""
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    with pytest.raises(RuntimeError, match="CuPy.*cuda13 extra.*device_staging_blocks to 0"):
        DeviceStaging(4, [0], [4096], [4096], device="cpu")
