"""The copier's tuning is one frozen value (CPU): validated once, the shipped defaults unchanged,
set from `kvstore serve --copy-*` and handed by the service to its registry."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli.command import build_parser
from kvstore.cli.copies import copy_settings_from_args
from kvstore.engines.copy_settings import CopyMethod, CopySettings

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_the_defaults_are_the_shipped_tuning() -> None:
    settings = CopySettings()
    assert settings.small_runs is CopyMethod.STAGED and settings.large_runs is CopyMethod.BATCH
    assert settings.packed_min_pieces == 2
    assert settings.chunk_bytes == 32 << 20 and settings.staging_slot_bytes == 32 << 20
    assert settings.load_chunk_bytes == 128 << 20 and settings.load_growth == 4
    assert settings.save_kernels is False  # saves stay on the copy engines


def test_methods_by_name_become_members_and_the_value_is_frozen() -> None:
    settings = CopySettings(small_runs="kernel", large_runs="memcpy")
    assert settings.small_runs is CopyMethod.KERNEL and settings.large_runs is CopyMethod.MEMCPY
    assert settings == CopySettings(small_runs=CopyMethod.KERNEL, large_runs=CopyMethod.MEMCPY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.small_runs = CopyMethod.BATCH  # type: ignore[misc]


@pytest.mark.parametrize(("field", "value"), [
    ("small_runs", "fast"), ("large_runs", ""), ("packed_min_pieces", 0),
    ("packed_min_pieces", True), ("packed_min_pieces", 2.0), ("chunk_bytes", -1),
    ("save_kernels", "yes"), ("save_kernels", 1),
    ("staging_slot_bytes", 0), ("kernel_unroll", 5), ("kernel_unroll", True),
    ("kernel_unroll", "8"), ("batch_keeps_gil", 1), ("load_growth", 1),
    ("load_growth", 2.0), ("load_chunk_bytes", -1), ("wait_poll_us", -1),
    ("wait_poll_us", 20.0),
])
def test_bad_values_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        CopySettings(**{field: value})


def test_no_copy_flag_means_the_default_settings() -> None:
    args = build_parser().parse_args(["serve"])
    assert copy_settings_from_args(args) == CopySettings()


def test_every_copy_flag_sets_its_field() -> None:
    args = build_parser().parse_args([
        "serve", "--copy-small-runs", "kernel", "--copy-large-runs", "staged",
        "--copy-packed-min-pieces", "1073741824", "--copy-chunk-size", "0",
        "--copy-staging-slot-size", "64MiB", "--copy-kernel-unroll", "16",
        "--copy-save-kernels", "--copy-batch-keeps-gil", "--copy-load-growth", "2",
        "--copy-load-chunk-size", "0", "--copy-wait-poll-us", "20"])
    assert copy_settings_from_args(args) == CopySettings(
        small_runs=CopyMethod.KERNEL, large_runs=CopyMethod.STAGED,
        packed_min_pieces=1 << 30, chunk_bytes=0, staging_slot_bytes=64 << 20,
        kernel_unroll=16, save_kernels=True, batch_keeps_gil=True, load_growth=2,
        load_chunk_bytes=0, wait_poll_us=20)


@pytest.mark.parametrize("flags", [["--copy-small-runs", "fast"],
                                   ["--copy-staging-slot-size", "0"],
                                   ["--copy-packed-min-pieces", "0"],
                                   ["--copy-chunk-size", "lots"],
                                   ["--copy-kernel-unroll", "5"],
                                   ["--copy-load-growth", "1"],
                                   ["--copy-load-chunk-size", "lots"],
                                   ["--copy-wait-poll-us", "-1"]])
def test_serve_refuses_a_bad_copy_flag_in_one_line_before_starting(flags: list[str],
                                                                   tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--socket",
                           str(tmp_path / "s.sock"), "--http", "off", "--dram", "16MiB", *flags],
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 2, done.stderr
    assert flags[0] in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "allocating" not in done.stdout  # refused before the pool was set up


def test_the_service_hands_its_copy_settings_to_the_registry() -> None:
    from kvstore.daemon.service import Service
    from kvstore.store.config import StoreConfig
    from kvstore.store.tiered import TieredStore

    settings = CopySettings(large_runs="memcpy", chunk_bytes=0)
    with TieredStore(StoreConfig(dram_bytes=1 << 20, pin_memory=False)) as store:
        service = Service(store, copy_settings=settings)
        try:
            assert service.registry.copy_settings is settings
        finally:
            service.close()
        default = Service(store)
        try:
            assert default.registry.copy_settings == CopySettings()
        finally:
            default.close()
